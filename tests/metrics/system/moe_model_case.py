"""Child process of test_moe.py: register_router_hooks on a tiny megatron-core MoE GPT.

    python -m tests.metrics.system.moe_model_case [--mtp]   # --mtp: one multi-token-prediction layer

Prints one JSON line: the metric's results ("got") and the same keys computed from
what the routers themselves returned and megatron-core's aux-loss tracker holds
("want"), plus the checks of when='train' and of removing the hooks.
"""
import json
import sys
import warnings

import torch
import torch.distributed as dist

from tests.moeref import reference
from twinkle_metrics import DeviceMesh, MoERoutingMetric, register_router_hooks

LAYERS, EXPERTS, TOPK, VOCAB, SEQ, BATCH = 2, 4, 2, 32, 8, 3
MTP = 1 if "--mtp" in sys.argv else 0
SLOTS = LAYERS + MTP  # the tracker's layers: the decoder's, then the MTP ones


def cpu_megatron():
    """megatron-core's MoE on CPU: the package's shim covers the router and moe_utils."""
    from twinkle_metrics.integrations import megatron_cpu

    megatron_cpu.enable()


def build():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
        moe_expert_capacity_factor=1.0, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, mtp_num_layers=MTP or None)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS)
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if MTP else None
    with warnings.catch_warnings():  # 0.19 asks for HybridModel; GPTModel is the subject here
        warnings.simplefilter("ignore", DeprecationWarning)
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        mtp_block_spec=mtp)


def megatron_tracker():
    """megatron-core's per-layer aux-loss values, ``{name: [values]}``, read as this
    megatron-core documents it (0.18+: the metrics tracker; before: the layer-wise dict)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        return {n: e.values.tolist() for n, e in moe_utils.get_moe_metrics_tracker().metrics.items()}
    return {n: e["values"].tolist() for n, e in moe_utils.get_moe_layer_wise_logging_tracker().items()}


def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    ps.initialize_model_parallel(create_gloo_process_groups=False)
    model = build()
    metric = MoERoutingMetric(DeviceMesh.from_megatron(), num_layers=SLOTS, num_experts=EXPERTS)
    hooks = register_router_hooks(model, metric)

    # What the routers return, seen by a hook of the test's own (registered after ours).
    calls = []
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]

    def record(module, args, kwargs, output):
        if module.training and torch.is_grad_enabled():
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            logits = x @ module.weight.detach().double().t()
            padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
            if padding is None:  # 0.16's MTP layer passes none: every token counts
                padding = torch.zeros(x.shape[0], dtype=torch.bool)
            valid = ~padding.reshape(-1)
            routed = (output[1] & valid[:, None]).sum()
            # megatron-core's tracker slot: 0.19 numbers MTP routers from 1 after the decoder
            slot = module.layer_number - 1 + (LAYERS if getattr(module, "is_mtp_layer", False) else 0)
            calls.append((slot, {
                "routing_map": output[1].detach().clone(), "token_mask": valid,
                "router_logits": logits, "tokens_dropped": int(TOPK * valid.sum() - routed)}))

    for r in routers:
        r.register_forward_hook(record, with_kwargs=True)

    g = torch.Generator().manual_seed(1)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]

    def forward():
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        padding[0, -3:] = True  # [bsz, seq], True = padding (megatron-core's GPTModel)
        return model(tokens, pos, causal, labels=tokens, padding_mask=padding)

    clear_aux_losses_tracker()
    model.train()
    microbatches = 2
    with warnings.catch_warnings(record=True) as seen:  # what the library's own calls raise
        warnings.simplefilter("always")
        for _ in range(microbatches):
            forward().sum().backward()
        got = metric.calculate()
    own_warnings = [f"{w.category.__name__}: {w.message}" for w in seen if "twinkle_metrics" in w.filename]

    want = reference(calls, SLOTS, EXPERTS)
    tracker = megatron_tracker()
    for name, key in (("load_balancing_loss", "aux_loss"), ("z_loss", "z_loss")):
        per_layer = [float(v) / microbatches for v in tracker[name]]
        assert len(per_layer) == SLOTS, per_layer
        for i, v in enumerate(per_layer):
            want[f"moe/layer{i}/{key}"] = v
        want[f"moe/{key}"] = sum(per_layer) / SLOTS

    model.eval()
    with torch.no_grad():
        forward()
    eval_results = metric.calculate()

    model.train()
    hooks.remove()
    forward()
    after_remove = metric.calculate()
    print(json.dumps({"got": got, "want": want, "layers": hooks.layers, "warnings": own_warnings,
                      "dropped_any": want["moe/tokens_dropped"] > 0, "eval_results": eval_results,
                      "after_remove": after_remove,
                      "gating_restored": all("gating" not in r.__dict__ for r in routers)}))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
