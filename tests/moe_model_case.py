"""Child process of test_moe.py: register_router_hooks on a tiny megatron-core MoE GPT.

Prints one JSON line: the metric's results ("got") and the same keys computed from
what the routers themselves returned and megatron-core's aux-loss tracker holds
("want"), plus the checks of when='train' and of removing the hooks.
"""
import json

import torch
import torch.distributed as dist

from tests.moeref import reference
from twinkle_metrics import DeviceMesh, MoERoutingMetric, register_router_hooks

LAYERS, EXPERTS, TOPK, VOCAB, SEQ, BATCH = 2, 4, 2, 32, 8, 3


def cpu_megatron():
    """megatron-core's MoE on CPU: the package's shim covers the router and moe_utils."""
    from twinkle_metrics.integrations import megatron_cpu

    megatron_cpu.enable()


def build():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
        moe_expert_capacity_factor=1.0, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS),
                    vocab_size=VOCAB, max_sequence_length=SEQ)


def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    ps.initialize_model_parallel(create_gloo_process_groups=False)
    model = build()
    metric = MoERoutingMetric(DeviceMesh.from_megatron(), num_layers=LAYERS, num_experts=EXPERTS)
    hooks = register_router_hooks(model, metric)

    # What the routers return, seen by a hook of the test's own (registered after ours).
    calls = []
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]

    def record(module, args, kwargs, output):
        if module.training and torch.is_grad_enabled():
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            logits = x @ module.weight.detach().double().t()
            valid = ~kwargs.get("padding_mask", args[1] if len(args) > 1 else None).reshape(-1)
            routed = (output[1] & valid[:, None]).sum()
            calls.append((module.layer_number - 1, {
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
    for _ in range(microbatches):
        forward().sum().backward()
    got = metric.calculate()

    want = reference(calls, LAYERS, EXPERTS)
    tracker = get_moe_layer_wise_logging_tracker()
    for name, key in (("load_balancing_loss", "aux_loss"), ("z_loss", "z_loss")):
        per_layer = [float(v) / microbatches for v in tracker[name]["values"]]
        for i, v in enumerate(per_layer):
            want[f"moe/layer{i}/{key}"] = v
        want[f"moe/{key}"] = sum(per_layer) / LAYERS

    model.eval()
    with torch.no_grad():
        forward()
    eval_results = metric.calculate()

    model.train()
    hooks.remove()
    forward()
    after_remove = metric.calculate()
    print(json.dumps({"got": got, "want": want, "layers": hooks.layers,
                      "dropped_any": want["moe/tokens_dropped"] > 0, "eval_results": eval_results,
                      "after_remove": after_remove,
                      "gating_restored": all("gating" not in r.__dict__ for r in routers)}))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
