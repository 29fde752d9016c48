"""Does vLLM's CPU W4A16 GEMM round the dequantized weight q*s to the activation dtype before the product?"""
import torch
from vllm import _custom_ops as ops
from vllm.scalar_type import scalar_types
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    pack_quantized_values_into_int32, unpack_quantized_values_into_int32)

torch.manual_seed(0)
K, N, G = 256, 64, 32
for dt in (torch.float16, torch.bfloat16):
    levels = torch.randint(-8, 8, (K, N), dtype=torch.int32)
    # scales with a full fp16 mantissa so that q*s is not representable in fp16/bf16 for most levels
    scales = (torch.rand(K // G, N) * 0.02 + 0.01).to(torch.float16).to(dt)
    wq = pack_quantized_values_into_int32(levels + 8, scalar_types.uint4b8, 0)  # GPTQ: packed along K
    # the kernel's own prepack (CPUWNA16LinearKernel._process_gptq_weights_w4a16)
    w = unpack_quantized_values_into_int32(wq, scalar_types.uint4b8, 0)
    w = pack_quantized_values_into_int32(w, scalar_types.uint4b8, 1)
    w = w.view(K, -1, 2).permute(1, 0, 2).reshape(-1, K * 2).contiguous()
    x = (torch.randn(4, K)).to(dt)
    out = ops.cpu_gemm_wna16(input=x, q_weight=w, scales=scales, zeros=None, bias=None, pack_factor=8, isa_hint="vec")
    s_full = scales.float().repeat_interleave(G, dim=0)
    w_exact = levels.float() * s_full              # fp32(q*s): exact
    w_round = w_exact.to(dt).float()               # dt(q*s): rounded like Marlin / the Triton gather
    ref_exact = (x.float() @ w_exact).to(dt)
    ref_round = (x.float() @ w_round).to(dt)
    diff_w = (w_exact != w_round).float().mean().item()
    print(f"{dt}: weights where dt(q*s) != q*s: {diff_w:.1%}; "
          f"kernel == x@dt(q*s): {(out == ref_round).float().mean().item():.1%}, "
          f"kernel == x@(q*s exact): {(out == ref_exact).float().mean().item():.1%}")
    # single-weight probe: x = one-hot rows pick weight rows exactly (no accumulation rounding)
    eye = torch.eye(K, dtype=dt)[:32]
    o = ops.cpu_gemm_wna16(input=eye, q_weight=w, scales=scales, zeros=None, bias=None, pack_factor=8, isa_hint="vec")
    print(f"  one-hot rows: kernel == dt(q*s) for {(o.float() == w_round[:32]).float().mean().item():.1%} of weights")
    # scaled one-hot (x = 1/3 in dt): distinguishes dt(q*s)*x from (q*s)*x
    third = torch.tensor(1/3, dtype=dt)
    o3 = ops.cpu_gemm_wna16(input=eye * third, q_weight=w, scales=scales, zeros=None, bias=None, pack_factor=8, isa_hint="vec")
    a = (w_round[:32] * third.float()).to(dt); b = (w_exact[:32] * third.float()).to(dt)
    print(f"  x=1/3 one-hot: kernel == dt(dt(q*s)*x) {(o3 == a).float().mean().item():.1%}, "
          f"== dt((q*s)*x) {(o3 == b).float().mean().item():.1%}, the two differ on {(a != b).float().mean().item():.1%}")

# The plugin's int4 embedding gather (the CPU stand-in for vLLM's Triton _dequant_gather_kernel).
from gemma4_t4_vllm import dequant_gather_torch

for dt in (torch.float16, torch.bfloat16):
    rows, hidden = 16, 64
    levels = torch.randint(-8, 8, (rows, hidden), dtype=torch.int32)
    scales = (torch.rand(rows, hidden // G) * 0.02 + 0.01).to(torch.float16).to(dt)
    nib = (levels + 8).reshape(rows, hidden // 8, 8)
    packed = torch.zeros(rows, hidden // 8, dtype=torch.int64)
    for j in range(8):
        packed |= nib[..., j].long() << (4 * j)
    packed = packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else packed.to(torch.int32)
    ids = torch.arange(rows)
    out = dequant_gather_torch(ids, packed, scales, hidden, 4)
    exact = levels.float() * scales.float().repeat_interleave(G, dim=1)
    print(f"gather {dt}: output dtype {out.dtype}; == {dt}(q*s) for {(out == exact.to(dt)).float().mean().item():.1%}"
          f"; q*s exact in {dt} for {(exact.to(dt).float() == exact).float().mean().item():.1%}")
