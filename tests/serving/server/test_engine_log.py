"""Engine-log parsing: the lines vLLM prints on the T4 (from the article's start) and on the CPU backend."""

from __future__ import annotations

from tools.serving.server import engine_log
from tools.serving.server.engine_log import explain_failure, parse_engine_log, tail

# Lines as vLLM 0.29 printed them on the T4 (the article's sweep start), with vLLM's process/time prefixes.
T4_LOG = """\
(APIServer pid=18273) INFO 09-29 10:01:02 [model.py:2152] Using max model len 16384
(EngineCore pid=18301) INFO 09-29 10:01:10 [core.py:133] Initializing a V1 LLM engine (v0.29.0) with config: model='xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4', device_config=cuda, seed=0
(Worker pid=18310) INFO 09-29 10:01:12 [compressed_tensors_wNa16.py:138] Using MarlinLinearKernel for CompressedTensorsWNA16
(Worker pid=18310) INFO 09-29 10:01:12 [cuda.py:446] Using TRITON_ATTN backend.
(Worker pid=18310) INFO 09-29 10:01:31 [gpu_model_runner.py:5150] Model loading took 2.86 GiB memory and 19.400900 seconds
(Worker pid=18310) INFO 09-29 10:01:33 [backends.py:296] Directly load the compiled graph(s) for compile range (1, 2048) from the cache, took 0.812 s
(Worker pid=18310) INFO 09-29 10:01:33 [monitor.py:91] torch.compile took 1.03 s in total
(EngineCore pid=18301) INFO 09-29 10:01:40 [kv_cache_utils.py:2327] GPU KV cache size: 1,099,587 tokens, Maximum concurrency for 16,384 tokens per request: 67.11x
(APIServer pid=18273) INFO:     Application startup complete.
"""

# Excerpt of a real start of the tiny int4-embedding build on vLLM 0.32's CPU backend (cold compile cache).
CPU_LOG = """\
(APIServer pid=6104) INFO 11-29 15:16:04 [api_utils.py:347]   █▄█▀ █     █     █     █  version 0.32.0
(APIServer pid=6104) INFO 11-29 15:16:16 [model.py:2152] Using max model len 512
(APIServer pid=6104) INFO 11-29 15:16:16 [config.py:286] Gemma4 model has heterogeneous head dimensions {'sliding_attention': 32, 'full_attention': 64}. FA4 not available, forcing TRITON_ATTN backend.
(EngineCore pid=6139) INFO 11-29 15:16:25 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/b1', device_config=cpu, seed=0
(Worker pid=6152) INFO 11-29 15:16:35 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for CompressedTensorsWNA16
(Worker pid=6152) INFO 11-29 15:16:35 [cpu.py:178] Cannot use AttentionBackendEnum.TRITON_ATTN backend on CPU.
(Worker pid=6152) INFO 11-29 15:16:35 [__init__.py:40] gemma4-t4: int4 embedding lookup runs as a torch gather (CompressedTensorsEmbeddingWNA16Int)
(Worker pid=6152) INFO 11-29 15:16:35 [default_loader.py:501] Loading weights took 0.02 seconds
(Worker pid=6152) INFO 11-29 15:16:36 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=6152) INFO 11-29 15:17:40 [decorators.py:743] [backbone] saved AOT compiled function to /root/.cache/vllm/torch_compile_cache/x/rank_0_0/model
(Worker pid=6152) INFO 11-29 15:17:41 [cpu_model_runner.py:91] Warming up done.
(Worker pid=6152) INFO 11-29 15:17:41 [cpu_worker.py:260] Explicitly set (1.0/8.09) GiB for KV cache on node 0.
(EngineCore pid=6139) INFO 11-29 15:17:41 [kv_cache_utils.py:2327] CPU KV cache size: 1,290,555 tokens, Maximum concurrency for 512 tokens per request: 2520.62x
INFO:     Application startup complete.
"""


def test_t4_start_fields():
    f = parse_engine_log(T4_LOG)
    assert f.vllm_version == "0.29.0" and f.platform == "cuda" and f.max_model_len == 16384
    assert (f.model_loading_gib, f.model_loading_s) == (2.86, 19.4009)
    assert f.kv_cache_tokens == 1_099_587
    assert (f.max_concurrency, f.max_concurrency_tokens) == (67.11, 16384)
    assert f.torch_compile_s == 1.03
    assert f.linear_kernel == "MarlinLinearKernel" and f.attention_backend == "TRITON_ATTN"
    assert f.cold_start is False and f.ready
    assert f.embedding_method is None  # vLLM does not log it on CUDA; start_server reads the config instead


def test_cpu_start_fields():
    f = parse_engine_log(CPU_LOG)
    assert f.vllm_version == "0.32.0" and f.platform == "cpu" and f.max_model_len == 512
    assert f.model_loading_gib is None and f.weights_loading_s == 0.02
    assert f.kv_cache_tokens == 1_290_555 and f.max_concurrency == 2520.62 and f.cpu_kv_cache_gib == 1.0
    assert f.linear_kernel == "CPUWNA16LinearKernel"
    assert f.embedding_method and "torch gather" in f.embedding_method
    assert f.attention_backend == "CPU_ATTN"
    assert f.cold_start is True and f.warmup_s == 65.0
    d = f.to_dict()
    assert d["kv_cache_tokens"] == 1_290_555 and "CPUWNA16LinearKernel for CompressedTensorsWNA16" in d["kernels"]


def test_an_avx2_cpu_names_the_plugins_int4_matmul_as_its_int4_linear_kernel():
    """On a CPU whose vLLM library has no cpu_gemm_wna16 the plugin's int4 matmul runs, and the start says so."""
    from gemma4_t4_vllm import wna16

    line = f"(Worker pid=6152) INFO 11-29 15:16:35 [wna16.py:87] {wna16.MARK}\n"
    assert wna16.MARK.startswith(engine_log.CPU_WNA16_MARK)
    f = parse_engine_log(CPU_LOG.replace("INFO:     Application", line + "INFO:     Application"))
    assert f.linear_kernel == "CPUWNA16LinearKernel (int4 matmul, gemma4-t4 CPU plugin)"
    assert parse_engine_log(CPU_LOG).linear_kernel == "CPUWNA16LinearKernel"


def test_unusable_compile_cache_is_a_cold_start_with_a_note():
    log = ("(Worker pid=1) WARNING 11-29 15:37:49 [decorators.py:333] [backbone] Compiling model again due to a load "
           "failure from /root/.cache/vllm/torch_compile_cache/torch_aot_compile/8a9a/rank_0_0/model, reason: "
           "'function' object has no attribute 'finalize_loading'\n"
           "(Worker pid=1) INFO 11-29 15:38:17 [decorators.py:743] [backbone] saved AOT compiled function to /x\n")
    f = parse_engine_log(log)
    assert f.cold_start is True
    assert f.compile_cache_note.endswith("'function' object has no attribute 'finalize_loading'")


def test_unknown_fields_stay_none():
    f = parse_engine_log("nothing useful here\n")
    assert f.kv_cache_tokens is None and f.cold_start is None and not f.ready


def test_explains_the_root_cause_not_the_wrapper():
    log = """\
(Worker pid=1) ERROR 11-29 15:20:41 [multiproc_executor.py:1063] Traceback (most recent call last):
(EngineCore pid=2) ERROR 11-29 15:20:41 [core.py:1510] RuntimeError: Worker failed with error 'triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 98304, Hardware limit: 65536'
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
    assert "out of resource: shared memory, Required: 98304" in explain_failure(log)
    log2 = "(EngineCore pid=2) ERROR 11-29 [core.py:1] ValueError: No supported config format found in /x\n" \
           "RuntimeError: Engine core initialization failed. See root cause above.\n"
    assert explain_failure(log2) == "ValueError: No supported config format found in /x"
    assert explain_failure("all fine\n") is None


def test_explains_an_argument_vllm_refused_by_its_argparse_line_not_its_usage():
    """vLLM's usage lists --log-level {CRITICAL,ERROR,...}: that line was the explanation of a refused flag."""
    usage = "usage: api_server.py [-h] [--headless]\n" + "".join(
        f"                     [--opt{i} X]\n" for i in range(30)) + \
        "                     [--log-level {CRITICAL,ERROR,WARNING,INFO,DEBUG,NOTSET}]\n                     [model_tag]\n"
    log = usage + "api_server.py: error: unrecognized arguments: --no-such-flag-xyz\n"
    assert explain_failure(log) == "api_server.py: error: unrecognized arguments: --no-such-flag-xyz"


def test_tail():
    assert tail("a\nb\nc\n", 2) == "b\nc" and tail("a", 0) == ""


def test_w8a8_linears_name_their_int8_kernel_over_the_int4_heads():
    from tools.serving.server.engine_log import parse_engine_log

    log = """\
(EngineCore pid=7) INFO 11-29 21:00:01 [cpu.py:40] Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8
(EngineCore pid=7) INFO 11-29 21:00:02 [wna16.py:88] Using CPUWNA16LinearKernel for CompressedTensorsWNA16
"""
    f = parse_engine_log(log)
    assert f.linear_kernel == "CPUInt8ScaledMMLinearKernel"
    assert f.kernels == ["CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8",
                         "CPUWNA16LinearKernel for CompressedTensorsWNA16"]


ULIMIT = ("(APIServer pid=7) WARNING 12-05 10:00:01 [system_utils.py:256] Found ulimit of 20000 and failed to "
          "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors "
          "like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n")


def test_a_line_every_start_prints_is_never_the_cause():
    assert explain_failure(ULIMIT + "\n(APIServer pid=7) INFO 12-05 10:00:02 [x.py:1] Loading weights\n") is None
    died = ULIMIT + "\n(EngineCore pid=8) ERROR 12-05 10:00:09 [core.py:1] RuntimeError: the engine died\n"
    assert explain_failure(died) == "RuntimeError: the engine died"
