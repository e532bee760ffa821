"""bench/decode_profile.py: the kernel-name categories on names CUDA profiles show, the per-step
breakdown's arithmetic, and one run of the script on CPU with the tiny model whose JSON must add up
(no timing is asserted: only that the numbers agree with each other)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_profile as D  # noqa: E402

NAMES = {
    # cuBLAS / cuBLASLt (Ampere, Hopper), CUTLASS
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "gemm",
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
    "false>(cublasLt::cublasSplitKParams<float>, __nv_bfloat16 const*, float const*, __nv_bfloat16*)": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false>"
    "(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, float>, float, float)": "gemm",
    # attention: flash, memory-efficient (CUTLASS-based: attention wins over gemm), the engine's Triton kernel
    "flash_fwd_splitkv_kernel": "attention",
    "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 64, 128, 4, cutlass::bfloat16_t> >, false, true, false>(Flash_fwd_params)": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
    "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": "attention",
    "_decode_attn": "attention",
    # sampling
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, "
    "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, c10::BFloat16 const*, int)": "sampling",
    "_block_stats": "sampling",
    "_draw": "sampling",
    "_gemma_rmsnorm": "norm/elementwise",  # holds "gemm"
    "void at_cuda_detail::cub::DeviceScanKernel<at_cuda_detail::cub::DeviceScanPolicy<float, std::plus<float> >"
    "::Policy900, float const*, float*>(float const*, float*, int)": "sampling",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
    "float, 4, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, float, 4, 4>)": "sampling",
    "void at::native::(anonymous namespace)::searchsorted_cuda_kernel<float>(long*, float const*, float const*, "
    "long, long, long, long, bool)": "sampling",
    "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
    "at::native::templates::cuda::uniform_and_transform<float, float, at::CUDAGeneratorImpl*>>(long, "
    "at::PhiloxCudaState)": "sampling",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<float, "
    "long, int>::Policy800, true, float, long, int>(int*, float const*, long*)": "sampling",
    # norms and elementwise
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(int, "
    "float, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)": "norm/elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::"
    "{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, "
    "std::array<char*, 2ul> >(int, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}, "
    "std::array<char*, 2ul>)": "norm/elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)":
        "norm/elementwise",
    "void at::native::roll_cuda_kernel<c10::BFloat16>(c10::BFloat16 const*, c10::BFloat16*, long, long, long, "
    "long, long, long)": "norm/elementwise",
    "void at::native::(anonymous namespace)::masked_fill_kernel(at::TensorIterator&, c10::Scalar const&)":
        "norm/elementwise",
    "triton_poi_fused_add_mul_0": "norm/elementwise",
    "triton_red_fused__to_copy_mean_mul_pow_rsqrt_0": "norm/elementwise",
    # copies
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
    "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned "
    "int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)": "copy",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_kernel_impl"
    "<at::native::OpaqueType<2> >(at::TensorIteratorBase&)::{lambda(char*, char const*, long)#1}>(int)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
    "unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*, unsigned int)": "copy",
    # other: sum reductions
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4> >(at::native::ReduceOp<float, unsigned int, float, 4, 4>)": "other",
    # CPU ops (the CPU profile)
    "aten::addmm": "gemm", "aten::softmax": "sampling", "aten::index_copy_": "copy", "aten::exp": "norm/elementwise",
    "aten::searchsorted": "sampling", "tether::cpu_decode_step": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kernel_category(name):
    assert D.kernel_category(name) == NAMES[name]
    assert D.kernel_category(name) in D.CATEGORIES


def test_breakdown_arithmetic():
    # two steps; "a" and "b" overlap by 1 µs, "Memset (Device)" lies apart
    work = [("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", 0.0, 4.0), ("_decode_attn", 3.0, 2.0),
            ("Memset (Device)", 10.0, 2.0), ("_decode_attn", 20.0, 2.0)]
    b = D.breakdown(work, steps=2)
    assert b["busy_ms"] == pytest.approx(10e-3 / 2)
    assert b["busy_union_ms"] == pytest.approx(9e-3 / 2)
    assert b["kernels"] == 2.0
    assert b["categories"]["attention"] == {"ms": pytest.approx(4e-3 / 2), "kernels": 1.0}
    assert [k["name"] for k in b["top"]] == ["ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
                                             "_decode_attn", "Memset (Device)"]
    assert b["top"][1]["calls"] == 1.0 and b["top"][1]["us_per_call"] == 2.0
    assert D.breakdown(work, steps=2, intervals=False)["busy_union_ms"] == b["busy_ms"]


def test_cpu_run_adds_up(tmp_path):
    out = tmp_path / "profile.json"
    B, P, T = 2, 8, 6
    D.main(["--device", "cpu", "--model", "tiny", "--batch", str(B), "--prompt-len", str(P),
            "--new-tokens", str(T), "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["steps"] == T - 1
    assert r["config"]["batch"] == B and r["config"]["new_tokens"] == T
    for key in ("device", "torch", "date", "commit"):
        assert key in r
    s, cats = r["per_step"], r["categories"]
    assert set(cats) == set(D.CATEGORIES)
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(s["busy_ms"], rel=1e-9, abs=1e-9)
    assert sum(c["kernels"] for c in cats.values()) == pytest.approx(s["kernels"])
    assert s["busy_ms"] > 0 and s["kernels"] > 0
    assert s["busy_union_ms"] == pytest.approx(s["busy_ms"])  # CPU: self times, nothing overlaps
    assert s["gap_ms"] == pytest.approx(s["wall_ms"] - s["busy_union_ms"])
    assert s["launches"] is None  # no GPU
    top = r["top"]
    assert 0 < len(top) <= 15 and [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    assert sum(k["ms"] for k in top) <= s["busy_ms"] * (1 + 1e-9)
    for k in top:
        assert k["category"] == D.kernel_category(k["name"])
    be = r["config"]["backend"]  # build_model fuses q|k|v and gate|up (bench/rollout.py)
    assert be["layers"] > 0 and be["qkv_fused"] == be["gate_up_fused"] == be["layers"]
    # the C decode step, when it builds here, is one op per step
    if r["config"]["backend"]["attention"] == "c":
        step = [k for k in top if k["name"] == D.CSTEP]
        assert step and step[0]["calls"] == pytest.approx(1.0)
    fl = r["floors"]
    assert fl["weight_bytes"] > 0 and fl["mean_context"] == P + T / 2
    assert fl["total_ms"] == pytest.approx(fl["weights_ms"] + fl["kv_ms"] + 2 * fl["logits_ms"])
    for c in ("gemm", "attention", "sampling"):
        assert cats[c]["floor_ms"] > 0 and cats[c]["x_floor"] == pytest.approx(cats[c]["ms"] / cats[c]["floor_ms"])


def test_cpu_run_of_episodes_times_its_host_checks(tmp_path):
    """--turns: an episode call (turns end at end tokens, replies fed back); every host check of the
    window is counted and timed, inside the decode wall."""
    out = tmp_path / "profile.json"
    D.main(["--device", "cpu", "--model", "tiny", "--batch", "4", "--prompt-len", "8", "--new-tokens", "40",
            "--turns", "8", "--json", str(out)])
    r = json.loads(out.read_text())
    s = r["per_step"]
    assert r["config"]["turns"] == 8
    assert s["checks"] >= 1 and s["checks"] <= r["steps"]  # the CPU checks every step until all end
    assert 0 < s["host_check_ms"] < s["wall_ms"]


def _ev(name, start, end, gpu=False, annotation=False):
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), is_async=False,
                           device_type=DeviceType.CUDA if gpu else DeviceType.CPU, is_user_annotation=annotation,
                           self_cpu_time_total=end - start)


def test_gpu_window_from_synthetic_events():
    """The CUDA path's cut and filters on events shaped as torch.profiler's: the window runs from the
    end of the wave's second sync to the end of its last; GPU kernels, memcpy and memset inside it
    count, the GPU copies of the record_function ranges and CUDA sync events do not; launches are
    the host's runtime calls."""
    ev = [_ev(D.WAVE, 0, 100, annotation=True), _ev(D.WAVE, 0, 100, gpu=True, annotation=True),
          _ev(D.SYNC, 1, 2, annotation=True), _ev(D.SYNC, 10, 20, annotation=True),  # after the prefill
          _ev(D.SYNC, 90, 95, annotation=True),
          _ev("prefill_gemm", 5, 15, gpu=True),  # ends before the window
          _ev("cudaGraphLaunch", 21, 22), _ev("cudaLaunchKernel", 60, 61), _ev("aten::nonzero", 59, 62),
          _ev("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 22, 30, gpu=True), _ev("_decode_attn", 30, 34, gpu=True),
          _ev("Memcpy DtoH (Device -> Pinned)", 61, 62, gpu=True), _ev("Event Sync", 62, 80, gpu=True),
          _ev(D.SYNC, 90, 95, gpu=True, annotation=True)]
    t0, t1 = D.decode_window(ev)
    assert (t0, t1) == (20, 95)
    work, launches = D.window_work(ev, t0, t1, on_gpu=True)
    assert [w[0] for w in work] == ["nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "_decode_attn",
                                    "Memcpy DtoH (Device -> Pinned)"]
    assert launches == ["cudaGraphLaunch", "cudaLaunchKernel"]
    b = D.breakdown(work, steps=1)
    assert b["busy_ms"] == pytest.approx(13e-3)
    assert {c: v["kernels"] for c, v in b["categories"].items() if v["kernels"]} == \
        {"gemm": 1, "attention": 1, "copy": 1}
