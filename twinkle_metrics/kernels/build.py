"""Every Triton kernel variant the metrics launch, compiled ahead of time for CUDA GPUs
with triton's own toolchain (TTIR, TTGIR, LLVM, PTX, ptxas): no GPU needed.

    .venv/bin/python -m benchmarks.kernel_build     # registers and spills per variant (~30 s)

Needs triton (the test extra) but no GPU; the metrics never import it. ``report()`` is
what that command saves.

``tests/kernels/test_triton_kernels.py`` compiles every variant to sm_90 (H100/H200) and sm_80
(A100) cubins and requires no register spills, so a kernel that the interpreter runs but
the compiler rejects fails in CI rather than on a user's first step; this script prints
what ptxas reports for each (registers per thread bound how many programs share an SM).
"""
from __future__ import annotations

import glob
import inspect
import math
import os
import re
import subprocess
import tempfile
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, cast

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: integer arguments that are row lengths or row strides: multiples of 16 in the usual launch
_ALIGNED_INTS = ("s", "n_cols", "outer_stride", "inner_stride")


class Variant(NamedTuple):
    """One kernel launch the metrics make, as compiled: argument types, constexprs, warps."""
    label: str
    kernel: object
    types: Dict[str, str]
    const: Mapping[str, Any]
    warps: int
    fp_fusion: bool = False
    #: a kernel that streams its inputs (judged on its load widths); False for one-program
    #: finishing kernels that read a few hundred bytes
    streaming: bool = True
    #: narrow (< 32-bit) loads allowed: per-token flags read beside a [tokens, experts] tile
    #: (1/E of its bytes; one byte a thread whatever the tile)
    narrow_ok: int = 0


def compile_for(kernel: Any, target: Any, types: Mapping[str, str], constexprs: Mapping[str, object],
                num_warps: int = 4, contiguous: bool = True, fp_fusion: bool = False) -> Any:
    """Compile ``kernel`` ahead of time to a cubin for ``target`` (triton's own LLVM and
    ptxas; no GPU involved): what the first launch on that GPU would do.

    ``contiguous``: specialise as triton does at launch for contiguous rows of a length
    that is a multiple of 16: column strides (``*_s1``) equal to 1 become constants, and
    pointers, row strides (``*_s0``) and lengths are known multiples of 16. That is what
    lets a kernel load 128 bits at a time, so it is what its load widths are judged on.
    """
    names = list(inspect.signature(kernel.fn).parameters)
    constexprs = dict(constexprs)
    attrs = {}
    if contiguous:
        constexprs.update({n: 1 for n in names if n.endswith("_s1") and n not in constexprs})
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs
                 and (types[n].startswith("*") or n.endswith("_s0") or n in _ALIGNED_INTS)}
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=target, options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion})


def compile_variant(v: Variant, target: Any, contiguous: bool = True) -> Any:
    return compile_for(v.kernel, target, v.types, v.const, v.warps, contiguous, v.fp_fusion)


def _blocks(lines: List[str]) -> Tuple[Dict[str, int], List[Tuple[Optional[str], List[str]]]]:
    """PTX lines as basic blocks ``(label, instructions)`` and each label's block index."""
    blocks: List[Tuple[Optional[str], List[str]]] = [(None, [])]
    for line in lines:
        text = line.split("//")[0].strip()
        if re.match(r"^\$L__BB\d+_\d+:", text):
            blocks.append((text[:-1], []))
        elif text and not text.startswith(("$", ".", "{", "}")):
            blocks[-1][1].append(text)
            if re.search(r"\bbra(?:\.uni)?\s", text):  # a branch ends its block
                blocks.append((None, []))
    return {label: i for i, (label, _) in enumerate(blocks) if label}, blocks


def loop_instructions(ptx: str) -> Optional[Tuple[int, int]]:
    """PTX instructions one iteration of the kernel's main loop issues, along its shortest
    and its longest path (a branch taken rarely, such as a rescale when a row's max grows,
    lies on the longest only); None for a kernel without a loop. The main loop is the
    largest region a backward branch closes."""
    index, blocks = _blocks(ptx.splitlines())
    loops = []
    for i, (_, body) in enumerate(blocks):
        for ins in body:
            m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ins)
            if m and m.group(1) in index and index[m.group(1)] <= i:
                loops.append((index[m.group(1)], i))
    if not loops:
        return None
    head, tail = max(loops, key=lambda hl: hl[1] - hl[0])
    best: Dict[int, Tuple[int, int]] = {head: (len(blocks[head][1]), len(blocks[head][1]))}
    for i in range(head, tail + 1):  # blocks in order; edges only go forward inside the loop
        if i not in best:
            continue
        low, high = best[i]
        body = blocks[i][1]
        jump = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", body[-1]) if body else None
        targets = []
        if jump and index.get(jump.group(1), -1) > i:
            targets.append(index[jump.group(1)])
        if not (jump and not body[-1].startswith("@")):  # falls through unless an unconditional jump
            targets.append(i + 1)
        for t in targets:
            if t <= tail:
                n = len(blocks[t][1])
                old = best.get(t)
                best[t] = (low + n, high + n) if old is None else (min(old[0], low + n), max(old[1], high + n))
    head_label = cast(str, blocks[head][0])  # a backward branch's target: labelled
    ends = [best[i] for i in best if any(re.search(r"bra(?:\.uni)?\s+" + re.escape(head_label) + ";", ins)
                                         for ins in blocks[i][1])]  # blocks that start the next iteration
    return min(e[0] for e in ends), max(e[1] for e in ends)


def global_loads(ptx: str) -> Dict[str, int]:
    """PTX global loads by kind (``ld.global.v4.b32``: 128 bits a thread per instruction)."""
    out: Dict[str, int] = {}
    for kind in re.findall(r"ld\.global(?:\.\w+)*?\.((?:v\d\.)?[bfu]\d+)\b", ptx):
        out[kind] = out.get(kind, 0) + 1
    return out


def narrow_loads(ptx: str) -> Dict[str, int]:
    """Global loads of less than 32 bits a thread: one element at a time (a streaming kernel
    should move 4 to 16 bytes per thread per load)."""
    return {k: n for k, n in global_loads(ptx).items() if not k.startswith("v") and int(k[1:]) < 32}


def variants() -> List[Variant]:
    """(label, kernel, argument types, constexprs, warps): the variants the metrics launch
    (their default tile widths and warps), in each input dtype they accept, both NaN
    policies, every flag that changes the code."""
    from twinkle_metrics.kernels import argmax_triton as triton_argmax
    from twinkle_metrics.kernels import dpo_triton, rl_triton, triton_common
    from twinkle_metrics.kernels import entropy_triton as triton_entropy
    from twinkle_metrics.kernels import moe_triton as triton_moe
    from twinkle_metrics.kernels import ppo_triton as triton_ppo
    from twinkle_metrics.kernels import rollout_triton as triton_rollout
    out = []
    strides = {n: "i32" for n in ("s", "rec_stride", "seq0", "lp_s0", "lp_s1", "m_s0", "m_s1", "old_s0", "old_s1",
                                  "adv_s0", "adv_s1", "ref_s0", "ref_s1", "ent_s0", "ent_s1", "tok_s0", "tok_s1",
                                  "pos_s0", "pos_s1")}
    lo, hi = math.log(0.8), math.log1p(0.28)
    rl_flags = [dict(HAS_OLD=1, HAS_ADV=1, HAS_REF=1, HAS_ENT=1, TOKEN_CLIP=1, BY_SIGN=1, SKIP=0, KEY=1),
                dict(HAS_OLD=1, HAS_ADV=1, HAS_REF=0, HAS_ENT=0, TOKEN_CLIP=0, BY_SIGN=1, SKIP=1, KEY=0),  # GSPO
                dict(HAS_OLD=1, HAS_ADV=1, HAS_REF=0, HAS_ENT=1, TOKEN_CLIP=1, BY_SIGN=0, SKIP=0, KEY=0),  # CISPO
                dict(HAS_OLD=0, HAS_ADV=1, HAS_REF=1, HAS_ENT=0, TOKEN_CLIP=1, BY_SIGN=1, SKIP=1, KEY=0)]
    for dtype in ("fp32", "fp64", "bf16"):
        for flags in rl_flags:
            types = dict(strides, lp_ptr=f"*{dtype}", m_ptr="*u8", old_ptr=f"*{dtype}", adv_ptr="*fp64",
                         ref_ptr=f"*{dtype}", ent_ptr="*fp32", tok_ptr="*i64", pos_ptr="*i64", part_ptr="*fp64",
                         rec_ptr="*fp64")
            const = dict({k: bool(v) for k, v in flags.items()}, LO=lo, HI=hi, N_COLS=rl_triton._N_COLS,
                         BLOCK=rl_triton.BLOCK, HAS_TOK=bool(flags["KEY"]), HAS_POS=False)
            out.append(Variant(f"GRPO {dtype} {flags}", rl_triton._rl_kernel, types, const, rl_triton.NUM_WARPS))
    out.append(Variant("GRPO unbounded clip", rl_triton._rl_kernel, types,
                dict(const, LO=-math.inf, HI=math.inf), rl_triton.NUM_WARPS))
    keyed = dict(const, **{k: bool(v) for k, v in rl_flags[0].items()}, HAS_TOK=True, HAS_POS=True)
    out.append(Variant("GRPO top-k records with position ids", rl_triton._rl_kernel, types, keyed,
                       rl_triton.NUM_WARPS))
    for two in (True, False):
        out.append(Variant(f"DPO row sums two={two}", dpo_triton._row_sums_kernel,
                    dict(a_ptr="*fp32", b_ptr="*bf16", m_ptr="*u8", out_ptr="*fp64", s="i32", a_s0="i32",
                         a_s1="i32", b_s0="i32", b_s1="i32", m_s0="i32", m_s1="i32"),
                    dict(TWO=two, BLOCK=1024), 4))
    for w in (2, 4):
        for skip in (False, True):
            out.append(Variant(f"DPO pairs w={w} skip={skip}", dpo_triton._pair_kernel,
                               dict(x_ptr="*fp64", f_ptr="*fp64", i_ptr="*i64", n="i32"),
                               dict(BETA=0.1, W=w, SKIP=skip, BLOCK=1024), 4))
    ppo_types = {n: "i32" for n in ("s", "v_s0", "v_s1", "m_s0", "m_s1", "old_s0", "old_s1", "oh_s0", "oh_s1",
                                    "ret_s0", "ret_s1", "rh_s0", "rh_s1", "adv_s0", "adv_s1", "ah_s0", "ah_s1")}
    for v_type, modes, skip in (("fp32", (1, 1, 1), False), ("fp64", (2, 1, 0), True), ("fp32", (0, 2, 2), False)):
        old, ret, adv = modes
        out.append(Variant(f"PPO tokens {v_type} old/ret/adv={modes} skip={skip}", triton_ppo._tokens_kernel,
                           dict(ppo_types, v_ptr=f"*{v_type}", m_ptr="*u8", old_ptr="*fp64", oh_ptr="*u8",
                                ret_ptr="*fp32", rh_ptr="*u8", adv_ptr="*fp64", ah_ptr="*u8", part_ptr="*fp64"),
                           dict(EPS=0.2, OLD=old, RET=ret, ADV=adv, SKIP=skip, BLOCK=triton_ppo.BLOCK), 4))
    for ret, adv in ((True, True), (False, False)):
        out.append(Variant(f"PPO finish ret={ret} adv={adv}", triton_ppo._finish_kernel,
                           dict(part_ptr="*fp64", f_ptr="*fp64", i_ptr="*i64", n_parts="i32"),
                           dict(RET=ret, ADV=adv, BLOCK=128), 4, streaming=False))
    experts = 64  # E_PAD = 64: 64 tokens of a 4096-element tile per program
    for label, flags, x_type in (("map+logits bf16", dict(HAS_MAP=1, HAS_X=1, LOGITS=1, F64=0), "*bf16"),
                                 ("map+logits fp32 masked skip", dict(HAS_MAP=1, HAS_X=1, LOGITS=1, F64=0,
                                                                      HAS_MASK=1, SKIP=1), "*fp32"),
                                 ("probs fp32", dict(HAS_MAP=0, HAS_X=1, LOGITS=0, F64=0), "*fp32"),
                                 ("logits fp64", dict(HAS_MAP=0, HAS_X=1, LOGITS=1, F64=1), "*fp64"),
                                 ("map only", dict(HAS_MAP=1, HAS_X=0, LOGITS=1, F64=0), "*fp32")):
        const = {k: bool(v) for k, v in dict(dict(HAS_MASK=0, SKIP=0), **flags).items()}
        out.append(Variant(f"MoE tokens {label}", triton_moe._tokens_kernel,
                           dict(map_ptr="*u8", x_ptr=x_type, mask_ptr="*u8", part_ptr="*fp64", n="i32",
                                map_s0="i32", x_s0="i32", mask_s0="i32"),
                           dict(const, E=experts, E_PAD=experts, mask_s0=1,  # a contiguous mask, as launched
                                BLOCK_T=triton_moe.TILE // experts // (2 if const["F64"] else 1)),
                           4, narrow_ok=2 if const["HAS_MASK"] else 0))
    for drop in (triton_moe.DROP_NONE, triton_moe.DROP_TENSOR, triton_moe.DROP_INT):
        out.append(Variant(f"MoE rows drop={drop}", triton_moe._rows_kernel,
                           dict(part_ptr="*fp64", aux_ptr="*fp32", z_ptr="*fp32", drop_ptr="*i64", counts_ptr="*i64",
                                f_ptr="*fp64", i_ptr="*i64", n_parts="i32", layer="i32", drop_value="i32"),
                           dict(L=48, E=experts, E_PAD=experts, HAS_MAP=True, HAS_X=True, HAS_AUX=True, HAS_Z=True,
                                DROP=drop, SKIP=drop == triton_moe.DROP_INT, L_PAD=64,
                                PB=triton_moe.ROWS_TILE // experts), 4, streaming=False))
    totals_types = dict(part_ptr="*fp64", f_ptr="*fp64", i_ptr="*i64", rows_ptr="*fp64", n_rows="i32", n_blk="i32")
    n_ext = len(rl_triton.EXTREMES)
    grpo_mins = sum(1 << e for e, c in enumerate(rl_triton.EXTREMES) if c.endswith("_min"))
    out.append(Variant("GRPO totals", triton_common._totals_kernel, totals_types,
                       dict(W=rl_triton._N_COLS, COLS=32, EXT0=rl_triton._N_SUM + n_ext, FLAG0=rl_triton._N_SUM,
                            PER_EXT=True, NEG=grpo_mins, ROWS=0, R0=0, R1=0, R2=0, BLOCK=64), 4, streaming=False))
    out.append(Variant("rollout totals", triton_common._totals_kernel, totals_types,
                       dict(W=triton_rollout._N_COLS, COLS=16, EXT0=triton_rollout._FLAG + 1,
                            FLAG0=triton_rollout._FLAG, PER_EXT=False, NEG=1 << triton_rollout.EXTREMES.index("d_min"),
                            ROWS=2, R0=0, R1=1, R2=0, BLOCK=64), 4, streaming=False))
    out.append(Variant("rollout sequences", triton_rollout._sequence_kernel,
                       dict(parts_ptr="*fp64", f_ptr="*fp64", i_ptr="*i64", n="i32", p_s0="i32", p_s1="i32"),
                       dict(BLOCK=256), 4, streaming=False))
    for skip in (False, True):
        out.append(Variant(f"rollout skip={skip}", triton_rollout._rollout_kernel,
                    dict(lp_ptr="*fp32", roll_ptr="*fp32", has_ptr="*u8", part_ptr="*fp64", s="i32",
                         lp_s0="i32", lp_s1="i32", roll_s0="i32", roll_s1="i32", has_s0="i32", has_s1="i32"),
                    dict(LO=math.log(0.5), HI=math.log(2.0), SKIP=skip, N_COLS=triton_rollout._N_COLS,
                         BLOCK=triton_rollout.BLOCK), 4))
    logit_types = dict(n_cols="i32", inner="i32", outer_stride="i64", inner_stride="i64")
    for dtype in ("bf16", "fp16", "fp32"):
        types = dict(logit_types, x_ptr=f"*{dtype}", out_ptr="*fp64", inv_t="fp32")
        for scaled in (False, True):  # temperature 1, and another
            out.append(Variant(f"entropy {dtype} scaled={scaled}", triton_entropy._partials_lean_kernel, types,
                               dict(SCALED=scaled, BLOCK=triton_entropy.BLOCK), triton_entropy.NUM_WARPS,
                               fp_fusion=True))
        out.append(Variant(f"entropy selects {dtype}", triton_entropy._partials_kernel, types,
                           dict(BLOCK=triton_entropy.BLOCK), triton_entropy.NUM_WARPS))
        for mode in (0, 1, 2):
            out.append(Variant(f"argmax {dtype} mode={mode}", triton_argmax._argmax_kernel,
                        dict(logit_types, x_ptr=f"*{dtype}", out_ptr="*i64", labels_ptr="*i64", offset="i32",
                             vocab="i32"), dict(MODE=mode, BLOCK=triton_argmax.BLOCK), triton_argmax.NUM_WARPS))
    return out


def ptxas_report(ptx: str, arch: int) -> Dict[str, int]:
    """Registers per thread and bytes of spill stores ptxas reports for ``ptx`` (``{}`` when
    triton's ptxas cannot say): a streaming kernel that spills reads and writes local
    memory per token, and registers bound how many programs share an SM."""
    tools = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                          "ptxas*")), reverse=True)  # the newest PTX first
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)  # sm_90a for Hopper's own instructions
    sm = target.group(1) if target else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for tool in tools:
            r = subprocess.run([tool, f"-arch={sm}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                               capture_output=True, text=True)
            spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
            regs = re.findall(r"Used (\d+) registers", r.stderr)
            if r.returncode == 0 and spills and regs:
                return {"registers": max(map(int, regs)), "spill_bytes": sum(map(int, spills))}
    return {}


def report(archs: Sequence[int] = (90, 80)) -> Dict[str, Dict[str, object]]:
    """What ptxas reports for every variant on each of ``archs`` (registers, spill bytes),
    with its warps, tile, PTX global loads by kind and main-loop instructions per element,
    keyed ``"sm_<arch> <label>"``."""
    out = {}
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for v in variants():
            ptx = compile_variant(v, target).asm["ptx"]
            row: Dict[str, Any] = dict(ptxas_report(ptx, arch), warps=v.warps, block=v.const.get("BLOCK"),
                                       loads=global_loads(ptx))
            loop = loop_instructions(ptx)
            if loop is not None and v.const.get("BLOCK"):  # per element a thread handles in one iteration
                per = v.const["BLOCK"] / (32 * v.warps)
                row["loop_instructions_per_element"] = [round(loop[0] / per, 1), round(loop[1] / per, 1)]
            out[f"sm_{arch} {v.label}"] = row
    return out
