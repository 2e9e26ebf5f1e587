"""The epilogue family as custom ops: ``kltriton::kl_reward`` (the per-token KL estimator, and the reward shaping
with each sequence's mean KL) and its gradient ``kltriton::kl_reward_backward`` (``kltriton.kernels.epilogue``): one
kernel each way instead of a string of ``[N]`` tensor ops."""

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype
from kltriton.kernels.epilogue import KlValues, Rows, Shaping
from kltriton.ops._define import BOOL, FLOAT, INT, OPTIONAL, STR, TENSOR, Group, define_op

KL_VALUES = Group(KlValues, (TENSOR, OPTIONAL))
ROWS = Group(Rows, (INT, INT, OPTIONAL))
SHAPING = Group(Shaping, (OPTIONAL, OPTIONAL, OPTIONAL), optional=True)
_INPUTS = (("values", KL_VALUES), ("ref_logp", TENSOR), ("ref_given", BOOL), ("target", TENSOR), ("rows", ROWS),
           ("estimator", STR), ("kl_clamp", FLOAT))


def _launch(args):
    return tuple(dispatch.implementation("epilogue", args.backend).kl_reward(
        args.values, args.ref_logp, args.ref_given, args.target, args.rows, args.estimator, args.kl_clamp,
        args.shaping, args.score_clip))


def _fake(args):
    n, num_seqs = args.target.shape[0], args.rows.num_seqs
    new = lambda size: args.values.logp.new_empty(size, dtype=accumulation_dtype(args.values.logp.dtype))  # noqa: E731
    shaped = args.shaping is not None
    return (new(n), new(n if args.ref_given else 0), new(n if shaped else 0), new(num_seqs if shaped else 0),
            new(num_seqs if shaped else 0))


kl_reward_backward = define_op(
    "kl_reward_backward",
    inputs=(*_INPUTS, ("coef", OPTIONAL), ("count", OPTIONAL), ("g_kl", OPTIONAL), ("g_reward", OPTIONAL),
            ("g_kl_per_seq", OPTIONAL), ("backend", STR)),
    outputs=("g_logp", "g_full_kl"),
    launch=lambda args: tuple(dispatch.implementation("epilogue", args.backend).kl_reward_backward(
        args.values, args.ref_logp, args.ref_given, args.target, args.rows, args.estimator, args.kl_clamp, args.coef,
        args.count, *(None if g is None else g.contiguous() for g in (args.g_kl, args.g_reward, args.g_kl_per_seq)))),
    fake=lambda args: tuple(args.values.logp.new_empty(n) for n in (
        (0, args.target.shape[0]) if args.estimator == "full" else (args.target.shape[0], 0))))


def _backward(saved, grads):
    g_logp, g_full_kl = kl_reward_backward(saved.values, saved.ref_logp, saved.ref_given, saved.target, saved.rows,
                                           saved.estimator, saved.kl_clamp,
                                           *((None, None) if saved.shaping is None else (saved.shaping.coef, saved.count)),
                                           grads["kl"], grads.get("reward"), grads.get("kl_per_seq"), saved.backend)
    full = saved.estimator == "full"
    return {"values": (None if full else g_logp, g_full_kl if full else None)}


kl_reward = define_op(
    "kl_reward",
    inputs=(*_INPUTS, ("shaping", SHAPING), ("score_clip", FLOAT), ("backend", STR)),
    outputs=("kl", "ref_out", "reward", "kl_per_seq", "count"), launch=_launch, fake=_fake,
    save=(*(name for name, _ in _INPUTS), "shaping", "backend", "count"), backward=_backward, materialize_grads=False,
    grad_outputs=lambda args: ("kl", "reward", "kl_per_seq") if args.shaping is not None else ("kl",))
