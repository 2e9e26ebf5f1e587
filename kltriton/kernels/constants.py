"""The one table of values shared by the Python layer, the Triton kernels, the C++ kernels and ``setup.py``.

No torch import: ``setup.py`` loads this file by path to build the C++ library ahead of time with
exactly the flags of the JIT build. The C++ sources receive every value below as a ``-D`` define from
``cpp_compile_flags`` (``cpp_defines``), so each is written once, here.
"""

# The per-row ``target`` every kernel family takes (``[N]`` int64): a label in ``[0, V)`` to score,
# or one of these sentinels. Kernels never read the logits of a sentinel row.
SKIP = -1          # not scored: outputs 0.0, gradient 0
OUT_OF_RANGE = -2  # scored, but the label lies outside [0, V) (validation off): outputs NaN

# --- the layout family: what a target kernel found wrong in its inputs (kltriton.kernels.layout), one bit each,
# ORed into a per-device int64 flag vector of FLAG_SLOTS entries (validation without a host read on a device).
BAD_LABEL, BAD_CU_SEQLENS_ENDS, BAD_CU_SEQLENS_ORDER, BAD_TEMPERATURE = 1, 2, 4, 8
# An id outside [-1, V) of a TopK teacher or of a replay support (recorded by PyTorch ops: kltriton.functional.
# token_divergence, kltriton.truncation)
BAD_TOPK_ID, BAD_SUPPORT_ID = 16, 32
# the bits, a bad label, cu_seqlens' first and last offsets, a bad TopK id, a bad support id
FLAG_SLOTS = ("bits", "label", "cu_first", "cu_last", "topk_id", "support_id")

# --- the stream family's statistics (kltriton.kernels.statistics declares what each one means) ---
# Request bits: a forward computes the statistics whose bit is in its request (0: always computed).
# A kernel variant is compiled per request (Triton constexprs, C++ template MODE).
ENTROPY, REF, FULL_KL = 1, 2, 4
FORWARD_KL = 8  # KL(q || p) of the reference (a distillation teacher) against the policy (the student)
# A trainer head's three metrics (TRL's FusedCausalLMOutput: is_top1, the mean logit, log_sum_sq_probs), one bit for
# them (each is one more term of the same pass); policy rows only: never with the reference bits. The streamed values
# merge exactly over vocab pieces: the sum of the logits (the mean is sum / V) and the row's max (is_top1's merge).
HEAD = 16
# sum_logits is kept times this (the kernels' h units, 2^-33): finfo.min logits never overflow the sum (the mean does
# not; a sum of a few does), and every vocab piece's sum merges by addition.
LOGIT_SUM_SCALE = 2.0 ** -33
NEEDS_REF = REF | FULL_KL | FORWARD_KL  # the request bits that read the reference logits
# A mode bit of a request, not a statistic: the rows' sums in fixed point, bitwise independent of where the vocabulary
# is cut (the invariant mode, ``kltriton.kernels.invariant``). The statistics and truncation ops and the vocab-parallel
# passes read it and run the ``invariant`` family; no kernel ever sees it.
INVARIANT = 32
# The statistics in the order of every bundle (``StreamStats``; the kernels' stacked ``[NUM_STATS, N]`` outputs,
# indexed by position here), with the request bit that asks for each.
STATISTICS = (("logp", 0), ("lse", 0), ("entropy", ENTROPY), ("ref_logp", REF), ("ref_lse", REF),
              ("full_kl", FULL_KL), ("forward_kl", FORWARD_KL),
              ("is_top1", HEAD), ("sum_logits", HEAD), ("log_sum_sq_probs", HEAD), ("max_logit", HEAD))
# The stream backward's gradient, per row, on this basis (each coefficient already divided by T; the kernels take
# the coefficients as one stacked ``[len(GRADIENT_BASIS), N]`` tensor, indexed by position here):
#   grad = c_label * onehot(label) - p * (c_p + c_p_logp * log p + c_p_logq * log q) - c_q * q
GRADIENT_BASIS = ("label", "p", "p_logp", "p_logq", "q")
# Backward variants: which optional basis terms (those after label and p) a kernel evaluates, one bit each in
# GRADIENT_BASIS order.
BASIS_BITS = {term: 1 << i for i, term in enumerate(GRADIENT_BASIS[2:])}
P_LOGP, P_LOGQ = BASIS_BITS["p_logp"], BASIS_BITS["p_logq"]
Q = BASIS_BITS["q"]  # the reference's probabilities (the forward KL's gradient p - q)
BASIS_NEEDS_REF = P_LOGQ | Q  # the basis terms that read the reference logits


def request_bits() -> int:
    """All request bits together."""
    bits = 0
    for _, bit in STATISTICS:
        bits |= bit
    return bits

# --- order-independent sums ----------------------------------------------------------------------------
# A sum of values in [0, 1] (exp(z - max) of a row) as int64 in units of 2^-FIXED_POINT_BITS, each term truncated
# toward zero: integer addition is associative, so the sum does not depend on the order of its terms or on how
# many zero terms (padding) it has (replay: ``kltriton.kernels.truncation.replay``; the invariant mode:
# ``kltriton.kernels.invariant``). Up to 2^(63 - bits) terms.
FIXED_POINT_BITS = 40

# --- the loss family ------------------------------------------------------------------------------
# Loss types and KL estimators cross into the kernels by name (Triton: constexpr strings; C++: matched
# once per call): each kernel file lists the ones it implements (kltriton.kernels.loss.terms: all).
# The loss kernels' float64 hyperparameter vector, by slot: data, so a new value never recompiles.
# log_ratio_clamp: the ratio is exp(clamp(logp - old, -c, c)) (verl: 20; TRL, torchrl: +inf, no clamp).
HYPERPARAMETERS = ("ratio_low", "ratio_high", "dual_clip", "kl_clamp", "log_ratio_clamp",
                   # the loss types' own parameters (kltriton.kernels.loss.terms.PARAMETERS), then kl_ratio:
                   # 1.0 multiplies the KL term by the importance ratio (TRL use_bias_correction_kl), 0.0 not
                   "delta", "tau_pos", "tau_neg", "clip_ratio_c", "dro_beta", "clip_cov_ratio", "clip_cov_lb",
                   "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                   "vespo_lambda_neg", "kl_ratio")

# The fused policy loss's metrics (its terms' kernel, kltriton.kernels.loss ``terms``), by slot of the metrics vector:
# the aggregated terms before their coefficients, then means over the scored positions, then the ratio's extremes.
LOSS_METRICS = ("pg_loss", "kl_loss", "entropy_loss", "clipfrac", "clipfrac_lower", "ppo_kl", "kl_mean",
                "entropy_mean", "ratio_max", "ratio_min")
# The aggregation modes (verl's agg_loss; kltriton.kernels.loss.weights), by index in the loss-inputs kernels.
AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# C++ sources of the CPU library (``csrc/``) and the headers their build depends on.
CPP_SOURCES = ("ops.cpp", "layout.cpp", "stream_forward.cpp", "stream_backward.cpp", "loss_forward.cpp", "gradient_buffer.cpp",
               "truncation.cpp", "divergence.cpp", "invariant.cpp", "epilogue.cpp", "loss_terms.cpp")
CPP_HEADERS = ("common.h", "row_forward.h", "row_backward.h", "loss_coefficients.h", "truncation.h", "row_mixture.h",
               "invariant.h", "layout.h", "loss_terms.h")

# Instruction-set flags per ATen CPU capability; a build never uses more than ATen detected.
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")  # in increasing order
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
    "DEFAULT": (),
}
# A tuple: torch's cpp_extension.load appends to the lists it is given.
CPP_LINK_FLAGS = ("-fopenmp",)


def cpp_defines() -> list:
    """This table as ``-D`` flags: ``KLTRITON_SKIP``, ``KLTRITON_STAT_<NAME>`` (index),
    ``KLTRITON_STAT_<NAME>_REQUEST`` (bit), ``KLTRITON_NUM_STATS``, ``KLTRITON_REQUEST_LIMIT`` and
    ``KLTRITON_NEEDS_REF``; ``KLTRITON_BASIS_<TERM>`` (index), ``KLTRITON_BASIS_<TERM>_BIT`` (optional terms),
    ``KLTRITON_NUM_BASIS``, ``KLTRITON_BASIS_LIMIT`` and ``KLTRITON_BASIS_NEEDS_REF``; ``KLTRITON_HP_<NAME>`` (slot)
    and ``KLTRITON_NUM_HP``; ``KLTRITON_FIXED_POINT_BITS``; ``KLTRITON_BAD_<INPUT>`` (flag bits),
    ``KLTRITON_FLAG_<SLOT>`` and ``KLTRITON_NUM_FLAGS``; ``KLTRITON_METRIC_<NAME>`` and ``KLTRITON_NUM_METRICS``."""
    flags = [f"-DKLTRITON_SKIP={SKIP}", f"-DKLTRITON_OUT_OF_RANGE={OUT_OF_RANGE}",
             f"-DKLTRITON_NUM_STATS={len(STATISTICS)}", f"-DKLTRITON_REQUEST_LIMIT={request_bits() + 1}",
             f"-DKLTRITON_NEEDS_REF={NEEDS_REF}", f"-DKLTRITON_NUM_BASIS={len(GRADIENT_BASIS)}",
             f"-DKLTRITON_BASIS_LIMIT={sum(BASIS_BITS.values()) + 1}", f"-DKLTRITON_BASIS_NEEDS_REF={BASIS_NEEDS_REF}",
             f"-DKLTRITON_NUM_HP={len(HYPERPARAMETERS)}", f"-DKLTRITON_FIXED_POINT_BITS={FIXED_POINT_BITS}",
             f"-DKLTRITON_BAD_LABEL={BAD_LABEL}", f"-DKLTRITON_BAD_CU_SEQLENS_ENDS={BAD_CU_SEQLENS_ENDS}",
             f"-DKLTRITON_BAD_CU_SEQLENS_ORDER={BAD_CU_SEQLENS_ORDER}", f"-DKLTRITON_BAD_TEMPERATURE={BAD_TEMPERATURE}",
             f"-DKLTRITON_NUM_FLAGS={len(FLAG_SLOTS)}"]
    flags += [f"-DKLTRITON_FLAG_{name.upper()}={i}" for i, name in enumerate(FLAG_SLOTS)]
    flags += [f"-DKLTRITON_METRIC_{name.upper()}={i}" for i, name in enumerate(LOSS_METRICS)]
    flags += [f"-DKLTRITON_NUM_METRICS={len(LOSS_METRICS)}"]
    flags += [f"-DKLTRITON_STAT_{name.upper()}={i}" for i, (name, _) in enumerate(STATISTICS)]
    flags += [f"-DKLTRITON_STAT_{name.upper()}_REQUEST={bit}" for name, bit in STATISTICS]
    flags += [f"-DKLTRITON_BASIS_{term.upper()}={i}" for i, term in enumerate(GRADIENT_BASIS)]
    flags += [f"-DKLTRITON_BASIS_{term.upper()}_BIT={bit}" for term, bit in BASIS_BITS.items()]
    flags += [f"-DKLTRITON_HP_{name.upper()}={i}" for i, name in enumerate(HYPERPARAMETERS)]
    return flags


def cpp_compile_flags(capability: str) -> list:
    """Compiler flags of a C++ build for ``capability`` (a key of ``ISA_FLAGS``)."""
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
            *cpp_defines(), *ISA_FLAGS[capability]]
