"""Differences between a sharded run and its single-process float64 reference."""
import math

# fp32 against float64. A loss, a metric or a gradient entry is a sum over ~10^2 tokens of terms that each carry
# ~1e-7 relative rounding (fp32 matmuls over H = 32..48, log-sum-exps over V = 1001); measured worst cases are
# 1.0e-6 (loss, metrics, step 2 after one SGD step) and 1.8e-6 (gradients, relative to the parameter's largest
# entry). The tolerances keep a 10x margin; a wrong shard, an unreduced gradient or a label shifted on the wrong
# slice is off by O(1).
FP32 = {"metric": (1e-5, 1e-6), "fraction": 1e-6, "grad": 1e-5, "value": 1e-5}
# bf16 compute (MixedPrecisionPolicy(param_dtype=bfloat16)): 8 mantissa bits, measured 1.2e-2 on gradients and
# 2e-3 on metrics; a token's clipping may flip (a clip fraction moves by 1/40).
BF16 = {"metric": (5e-2, 1e-3), "fraction": 0.1, "grad": 5e-2, "value": 5e-2}
# Metrics that count tokens or sequences: in fp32 equal up to float noise (one token more or less clipped is 1/40
# apart).
FRACTIONS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
             "clip_ratio/high_max", "frac_reward_zero_std", "num_tokens", "completions/mean_length")
NOT_COMPARED = ("step_time", "learning_rate", "epoch", "train_runtime")


def relative(expected, got) -> float:
    """max |got - expected| / max |expected| over a flat list."""
    scale = max((abs(x) for x in expected), default=0.0)
    return max((abs(x - y) for x, y in zip(expected, got)), default=0.0) / max(scale, 1e-30)


def log_differences(reference_logs, logs):
    """``[(step, key, expected, got, relative difference)]`` of every logged number."""
    out = []
    assert len(reference_logs) == len(logs), (len(reference_logs), len(logs))
    for step, (a, b) in enumerate(zip(reference_logs, logs), start=1):
        assert set(a) == set(b), (step, set(a) ^ set(b))
        for key, value in a.items():
            if key in NOT_COMPARED or not isinstance(value, (int, float)):
                continue
            out.append((step, key, value, b[key], abs(b[key] - value) / max(abs(value), 1e-30)))
    return out


def assert_logs_close(reference_logs, logs, tolerance):
    rtol, atol = tolerance["metric"]
    for step, key, expected, got, _ in log_differences(reference_logs, logs):
        if key in FRACTIONS:
            assert math.isclose(got, expected, abs_tol=tolerance["fraction"]), (step, key, expected, got)
        else:
            assert math.isclose(got, expected, rel_tol=rtol, abs_tol=atol), (step, key, expected, got)


def grad_differences(reference_grads, grads):
    """``{parameter: relative difference}``; every reference parameter must have a gradient."""
    assert set(grads) == set(reference_grads), set(grads) ^ set(reference_grads)
    return {name: relative(reference_grads[name], grads[name]) for name in reference_grads}


def assert_grads_close(reference_grads, grads, tolerance):
    worst = grad_differences(reference_grads, grads)
    bad = {name: d for name, d in worst.items() if d > tolerance["grad"]}
    assert not bad, bad
    return max(worst.values())
