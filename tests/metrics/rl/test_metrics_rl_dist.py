"""Multi-rank tests of the RL metrics on 8 real gloo ranks: sharded == whole."""
import contextlib
import math
import random

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.dist import sync_error
from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_rl_batch, ragged, ref_entropy
from twinkle_metrics import CISPOMetric, CompletionRewardMetric, DPOMetric, GRPOMetric, GSPOMetric, MetricCollection
from twinkle_metrics.testing import (
    CollectiveCounter,
    assert_layout_invariant,
    assert_results_close,
    forbid_device_waits,
)

pytestmark = pytest.mark.xdist_group("dist")

SEED = 21
N_SEQ, SEQ_LEN = 12, 8
OFFSET = 1e6


def _metrics(mesh, group=None):
    """``group``: a process_group given to every metric (the CP rules still follow the mesh)."""
    return MetricCollection({
        "grpo": GRPOMetric(None, group, top_k_kl=6),
        "gspo": GSPOMetric(None, group, epsilon=0.05, epsilon_high=0.08, top_k_kl=3),
        "cispo": CISPOMetric(None, group),
        "dpo": DPOMetric(None, group, beta=0.3),
        "": CompletionRewardMetric(None, group, reward_names=["acc", "fmt"], max_completion_length=15,
                                   num_generations=2),
    }, device_mesh=mesh)


def _rewards(rows):
    rng = random.Random(SEED)
    acc = [float(rng.choice([0, 1])) for _ in range(N_SEQ)]
    fmt = [OFFSET + rng.gauss(0, 1) for _ in range(N_SEQ)]
    lens = [rng.randint(1, 20) for _ in range(N_SEQ)]
    return ({"acc": [acc[i] for i in rows], "fmt": [fmt[i] for i in rows]}, [lens[i] for i in rows])


def _accumulate(coll, b, rows, cols, dpo_rows, gen_time, guard=contextlib.nullcontext):
    """Feed one rank's shard: GRPO family as 2 microbatches with Twinkle's ragged old
    logps, DPO interleaved pairs, rewards for whole prompt groups (the DPO pairs)."""
    reward_rows = list(dpo_rows)
    rows, dpo_rows = torch.tensor(list(rows)), torch.tensor(reward_rows)
    lab, pos = b["labels"][:, cols], b["pos"][:, cols]
    lp, old, ref = b["logps"][:, cols], b["old"][:, cols], b["ref"][:, cols]
    half = (len(rows) + 1) // 2
    parts = [rows[:half], rows[half:]]
    feats = [{"labels": lab[p], "position_ids": pos[p]} for p in parts]
    rl_kwargs = dict(old_logps=ragged(old[rows], lab[rows]), advantages=b["adv"][rows],
                     ref_logps=[ref[p] for p in parts])
    rl_outputs = {"logps": [lp[p] for p in parts]}
    rewards, lens = _rewards(reward_rows)
    with guard():
        for name in ("grpo", "gspo", "cispo"):
            coll[name].accumulate(feats, rl_outputs, **rl_kwargs)
        coll["dpo"].accumulate({"labels": lab[dpo_rows]}, {"logps": lp[dpo_rows]},
                               ref_outputs={"logps": ref[dpo_rows]})
        coll[""].accumulate(rewards=rewards, completion_lengths=lens, generate_time=gen_time)


def whole_results():
    b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
    coll = _metrics(DeviceMesh.single())
    _accumulate(coll, b, range(N_SEQ), torch.arange(SEQ_LEN), range(N_SEQ), 2.0)
    return coll.calculate()


def _mesh(source, sizes):
    if source == "megatron":
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=sizes.get("tp", 1),
                                     pipeline_model_parallel_size=sizes.get("pp", 1),
                                     context_parallel_size=sizes.get("cp", 1),
                                     create_gloo_process_groups=False)
        return DeviceMesh.from_megatron()
    return DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})


def case_sharded_equals_whole(source, sizes):
    try:
        mesh = _mesh(source, sizes)
        b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
        coll = _metrics(mesh, mesh.data_group if source == "group" else None)
        counts = None
        if mesh.is_last_stage:
            rows = dp_shards(N_SEQ, mesh.dp_size)[mesh.dp_rank]
            pairs = dp_shards(N_SEQ // 2, mesh.dp_size)[mesh.dp_rank]
            dpo_rows = range(2 * pairs.start, 2 * pairs.stop)
            cols = cp_slice(SEQ_LEN, mesh.cp_size, mesh.cp_rank)
            with CollectiveCounter() as c:
                _accumulate(coll, b, rows, cols, dpo_rows, 2.0, guard=forbid_device_waits)
            counts = c.total
        else:
            for m in coll:
                m.accumulate([], {})  # what a non-last stage gets from the schedule
        return coll.calculate(), counts, mesh.cp_size
    finally:
        if source == "megatron":
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()


def feed_rl(coll, shard):
    """One rank's part of interval ``shard.interval`` for the layout harness: its DP rows, its
    CP columns, on the last stage; what a schedule gives the other stages."""
    if not shard.is_last_stage:
        for m in coll:
            m.accumulate([], {})
        return
    b = make_rl_batch(SEED + shard.interval, N_SEQ, SEQ_LEN)
    rows = dp_shards(N_SEQ, shard.dp_size)[shard.dp_rank]
    pairs = dp_shards(N_SEQ // 2, shard.dp_size)[shard.dp_rank]
    _accumulate(coll, b, rows, cp_slice(SEQ_LEN, shard.cp_size, shard.cp_rank),
                range(2 * pairs.start, 2 * pairs.stop), 2.0)


def test_rl_metrics_layout_invariant(dist_pool):
    """The GRPO family, DPO and rewards in one collection, two intervals, on every layout of the
    harness (TP, CP and PP beside DP, and all three), against one process."""
    report = assert_layout_invariant(_metrics, feed_rl, ["dp2", "tp2xdp2", "cp2xdp2", "pp2xdp2", "tp2xpp2xdp2"],
                                     pool=dist_pool)
    first = report.reference[0]  # the comparison can fail: clipping and later KL records
    assert first["gspo/train/clip_ratio"] > 0 and len(first["grpo/_high_kl_records"]) == 6


@pytest.mark.parametrize("source,sizes", [pytest.param("megatron", dict(tp=2, pp=2, dp=2), marks=pytest.mark.megatron),
                                          pytest.param("megatron", dict(tp=2, cp=2, dp=2), marks=pytest.mark.megatron),
                                          ("group", dict(cp=2, dp=4))])  # process_group = DP x CP
def test_rl_metrics_sharded_equal_whole(dist_pool, source, sizes):
    whole = whole_results()
    # the comparison can fail: the data produce clipping, KL records and zero-std groups
    assert whole["gspo/train/clip_ratio"] > 0 and whole["grpo/train/clip_ratio"] > 0
    assert len(whole["grpo/_high_kl_records"]) == 6
    assert {r["gsi"] for r in whole["grpo/_high_kl_records"]} - set(range(6))  # later sequences too
    for got, counts, cp in dist_pool.run(case_sharded_equals_whole, source, sizes):
        assert_results_close(got, whole, rel=1e-9)
        if counts is not None:
            # accumulate's only collectives, for DPO and for GSPO each: one host-side CP
            # agreement (exchange.agree, on gloo) and one CP all_reduce
            assert counts == (4 if cp > 1 else 0)


def case_process_group_without_cp():
    mesh = DeviceMesh.from_sizes(cp_size=2, dp_size=4)
    m = DPOMetric(mesh, mesh.dp_group)  # DP only: the CP peers' token sums would be missing
    try:
        m.accumulate({"labels": torch.ones(2, 3, dtype=torch.long)}, {"logps": -torch.ones(2, 3)})
    except ValueError as e:
        return str(e)


def test_a_process_group_that_leaves_out_cp_raises_on_every_rank(dist_pool):
    for err in dist_pool.run(case_process_group_without_cp):
        assert err is not None and "pass the DP x CP group" in err, err


def case_entropy_vocab_parallel(chunking):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        mesh = DeviceMesh.from_megatron()
        b = make_rl_batch(SEED + 1, N_SEQ, SEQ_LEN, vocab=13)
        rows = list(dp_shards(N_SEQ, mesh.dp_size)[mesh.dp_rank])
        vocab_split = [7, 6]  # uneven vocab shards
        start = sum(vocab_split[:mesh.tp_rank])
        logits = b["logits"].float()[rows][:, :, start:start + vocab_split[mesh.tp_rank]]
        m = GRPOMetric(mesh, entropy_from_logits=True, vocab_parallel=True, temperature=0.8, **chunking)
        with CollectiveCounter() as c, forbid_device_waits():
            m.accumulate([{"labels": b["labels"][rows[:2]]}, {"labels": b["labels"][rows[2:]]}],
                         {"logps": b["logps"][rows], "logits": logits})
        return m.calculate()["train/entropy"], c.total
    finally:
        ps.destroy_model_parallel()


@pytest.mark.megatron
def test_entropy_vocab_parallel_matches_full_vocab(dist_pool):
    b = make_rl_batch(SEED + 1, N_SEQ, SEQ_LEN, vocab=13)
    want = ref_entropy(b["logits"], b["labels"], 0.8)
    # one chunk, chunks of 5 tokens, and one token per chunk (a budget below one row)
    for chunking in ({}, {"entropy_chunk_size": 5}, {"entropy_chunk_bytes": 1}):
        for got, count in dist_pool.run(case_entropy_vocab_parallel, chunking):
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
            # one host-side TP agreement (exchange.agree), then one MAX and one SUM all_reduce
            # over TP per accumulate, any chunking
            assert count == 3


def _reference_partials(chunks, t):
    """``(m, S, W)`` rows of the one-pass kernel for every chunk, in float64 torch (the
    kernel itself is tested under Triton's interpreter in test_triton_kernels.py)."""
    rows = []
    for c in chunks:
        y = c.to(torch.float64) / t
        m = y.amax(-1)
        d = (y - m[:, None]).clamp(min=torch.finfo(torch.float64).min)
        e = torch.exp(d)
        rows.append(torch.stack([m, e.sum(-1), (e * d).sum(-1)], 1))
    return torch.cat(rows)


def case_entropy_vocab_parallel_one_pass(chunking):
    """The vocab-parallel combine of the one-pass (Triton) path: shards' (m, S, W)
    re-based on the all-reduced row max, with the torch path's two collectives."""
    from twinkle_metrics.kernels import entropy

    saved = entropy._use_triton, entropy._triton_partials
    entropy._use_triton, entropy._triton_partials = (lambda chunks: bool(chunks)), _reference_partials
    try:
        return case_entropy_vocab_parallel(chunking)
    finally:
        entropy._use_triton, entropy._triton_partials = saved


def test_entropy_vocab_parallel_one_pass_path_matches_full_vocab(dist_pool):
    b = make_rl_batch(SEED + 1, N_SEQ, SEQ_LEN, vocab=13)
    want = ref_entropy(b["logits"], b["labels"], 0.8)
    for chunking in ({}, {"entropy_chunk_size": 5}):
        for got, count in dist_pool.run(case_entropy_vocab_parallel_one_pass, chunking):
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
            assert count == 3  # the agreement, then MAX and SUM: as the torch path


def case_reward_names_on_some_ranks():
    mesh = DeviceMesh.from_sizes(dp_size=8)
    m = CompletionRewardMetric(mesh)
    names = {"acc": [float(dist.get_rank())]}
    if dist.get_rank() == 3:
        names["fmt"] = [0.5, 1.5]
    m.accumulate(rewards=names)
    first = m.calculate()
    m.accumulate(rewards={"acc": [1.0]})  # the next interval: every rank knows "fmt" now
    return first, m.calculate()


def test_reward_names_seen_on_some_ranks_merge(dist_pool):
    """A reward name one rank met is created on the others (identity there): no error."""
    for first, second in dist_pool.run(case_reward_names_on_some_ranks, timeout=120):
        assert first["train/acc_reward"] == 3.5
        assert first["train/fmt_reward"] == 1.0
        assert math.isclose(first["train/fmt_reward_std"], 0.5 ** 0.5)
        assert second == {"train/acc_reward": 1.0, "train/acc_reward_std": 0.0}


def case_reward_names_fixed_on_one_rank():
    """Rank 0 fixes its reward names, the others take them as they come; rank 3 meets a name
    rank 0 could not create."""
    mesh = DeviceMesh.from_sizes(dp_size=8)
    rank = dist.get_rank()
    m = CompletionRewardMetric(mesh, reward_names=["acc"] if rank == 0 else None)
    m.accumulate(rewards={"acc": [1.0], **({"fmt": [0.5]} if rank == 3 else {})})
    return sync_error(m.calculate)


def test_reward_names_fixed_on_some_ranks_open_on_others_raise_everywhere(dist_pool):
    """Not a hang on the ranks that go on while one cannot create 'fmt': every rank raises."""
    for err in dist_pool.run(case_reward_names_fixed_on_one_rank, timeout=120):
        assert err is not None and "hold different metrics or arguments" in err
        assert "reward_names=('acc')" in err and "reward_names=None" in err  # fixed names against open ones


def _tied_batch():
    """Log-probs in bfloat16 steps: many tokens share one k3, so the top-k boundary is a tie
    (the case where torch.topk alone would pick by device and path, not by token)."""
    b = make_rl_batch(SEED + 3, N_SEQ, SEQ_LEN)
    lp = torch.full_like(b["logps"], -1.0)
    old = lp - torch.where(torch.arange(SEQ_LEN) % 3 == 0, 0.5, 0.25).expand_as(lp)  # two k3 values
    return b["labels"], lp, old, b["adv"]


def _tied_records(mesh, rows, micro):
    lab, lp, old, adv = _tied_batch()
    m = GRPOMetric(top_k_kl=5, device_mesh=mesh)
    parts = [rows[i:i + micro] for i in range(0, len(rows), micro)]
    for part in parts:  # several calls, each one microbatch of its rows
        m.accumulate({"labels": lab[part]}, {"logps": lp[part]}, old_logps=old[part], advantages=adv[part])
    return [(r["gsi"], r["pos"], r["kl"]) for r in m.calculate()["_high_kl_records"]]


def case_tied_records(dp):
    mesh = DeviceMesh.from_sizes(dp_size=dp)
    rows = list(dp_shards(N_SEQ, dp)[mesh.dp_rank])
    return _tied_records(mesh, rows, micro=2)


def test_top_kl_records_break_ties_by_token_order_on_any_layout(dist_pool):
    """With equal k3 at the boundary, the records are the earliest tokens (sequence, then
    position) whichever way the sequences were split over calls and DP ranks."""
    whole = _tied_records(DeviceMesh.single(), list(range(N_SEQ)), micro=N_SEQ)
    assert len(whole) == 5 and len({kl for _, _, kl in whole}) == 1  # all five tied
    lab = _tied_batch()[0]
    first = [(i, j) for i in range(N_SEQ) for j in range(SEQ_LEN) if lab[i, j] != -100 and j % 3 == 0][:5]
    assert [(g, p) for g, p, _ in whole] == first
    for got in dist_pool.run(case_tied_records, 8):
        assert got == whole


def _resume_batch(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(0, 5, (n, 4), generator=g)
    lp = -torch.rand(n, 4, generator=g, dtype=torch.float64)
    scale = 3.0 if seed == 99 else 1.0  # the batch fed after the resume holds the largest KL
    return {"labels": lab}, {"logps": lp}, lp - scale * torch.rand(n, 4, generator=g, dtype=torch.float64)


def _resume_feed(m, seed):
    i, o, old = _resume_batch(seed)
    m.accumulate(i, o, old_logps=old)


def case_resume_save():
    mesh = DeviceMesh.from_sizes(dp_size=8)
    m = GRPOMetric(top_k_kl=3, device_mesh=mesh)
    _resume_feed(m, mesh.dp_rank)
    return m.state_dict()


def case_resume_smaller(saved):
    """8 DP ranks' states resumed on 4 (x 2 TP replicas): new DP rank k loads old 2k and 2k+1;
    only the last one accumulates after the load."""
    mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4)
    m = GRPOMetric(top_k_kl=3, device_mesh=mesh)
    k = mesh.dp_rank
    m.load_state_dict([saved[2 * k], saved[2 * k + 1]])
    if k == 3:
        _resume_feed(m, 99)
    return [(r["gsi"], r["kl"]) for r in m.calculate()["_high_kl_records"]]


def test_top_kl_records_after_resuming_at_a_smaller_dp_size(dist_pool):
    """The README's resume pattern mid-interval, with only some new ranks accumulating before
    calculate(): the records keep their global sequence indices (the sequences of old ranks
    0..7, then the new batch)."""
    saved = dist_pool.run(case_resume_save)
    whole = GRPOMetric(top_k_kl=3)
    for seed in list(range(8)) + [99]:
        _resume_feed(whole, seed)
    want = [(r["gsi"], r["kl"]) for r in whole.calculate()["_high_kl_records"]]
    assert want[0][0] >= 24  # the largest KL is in the batch fed after the resume
    for got in dist_pool.run(case_resume_smaller, saved):
        assert [g for g, _ in got] == [g for g, _ in want]
        assert all(math.isclose(a, b, rel_tol=1e-12) for (_, a), (_, b) in zip(got, want))
