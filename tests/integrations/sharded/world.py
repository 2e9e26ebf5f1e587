"""What every rank of a sharded test runs: tiny models built from configs, accelerate relabelled as on GPUs, a
deterministic generation, gradient capture, and one job per trainer. Started by ``launch.run`` as
``python world.py SCENARIO.json``; writes ``rank{R}.json``."""
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

T0 = time.time()

import torch  # noqa: E402

VOCAB = 1001
WORDS = [f"w{i}" for i in range(3, VOCAB)]
PAD, EOS = 0, 2


# ------------------------------------------------------------------------------------------------- models
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def tiny_llama(path, seed=0, hidden_size=32, layers=2, dtype=torch.float32):
    """A Llama with random weights (``seed``), vocabulary 1001 and untied head, saved in ``dtype`` with its
    tokenizer (the same weights in any dtype: drawn in float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=PAD, bos_token_id=EOS, eos_token_id=EOS,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a head with spread: log-probs and gradients of every size
        model.lm_head.weight.mul_(8.0)
    model.to(dtype).save_pretrained(path)
    tokenizer().save_pretrained(path)


def prompts(n, seed=0, length=None):
    """``n`` distinct texts of ``length`` words (2 to 5 when None). Prompts that TRL left-pads all have one length:
    transformers numbers the positions of a left-padded row from its padding, so a prompt padded to the longest of a
    rank's batch and to the longest of the whole batch would be scored at other positions."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length_i = length or 2 + i % 4
        ids = torch.randint(3, VOCAB, (length_i,), generator=gen).tolist()
        out.append(" ".join(f"w{t}" for t in ids))
    return out


# ---------------------------------------------------------------------------------------- fake generation
def fake_generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
    """``generate`` without sampling streams: each completion is a function of its prompt's tokens and of how many
    copies of that prompt came before it in the batch (TRL puts a prompt's generations next to each other, in one
    rank's batch), so one process and two give the same completions. Some end early with EOS (masked tails)."""
    max_new = generation_config.max_new_tokens
    rows, seen = [], {}
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        key = tuple(t for t, m in zip(ids, mask) if m)
        copy = seen.get(key, 0)
        seen[key] = copy + 1
        digest = hashlib.sha256(repr((key, copy)).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        completion = torch.randint(3, VOCAB, (max_new,), generator=gen)
        stop = int(torch.randint(2, 2 * max_new, (1,), generator=gen))
        if stop < max_new:
            completion[stop] = EOS
            completion[stop + 1:] = PAD
        rows.append(completion)
    return torch.cat([input_ids, torch.stack(rows).to(input_ids.device)], dim=1)


def reward_ids(completion_ids, **kwargs):
    """A deterministic reward with spread inside every group: the fraction of even token ids, minus a length
    term."""
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) - 0.05 * len(c) for c in completion_ids]


# ------------------------------------------------------------------------------------ accelerate relabelled
RELABEL = {"kind": None}  # "fsdp" or "deepspeed" while a job of that layout builds its trainer


def relabel_accelerate():
    """accelerate starts FSDP and DeepSpeed only on accelerators: on CPU it silently trains plain DDP. Here the CPU
    processes (gloo) are relabelled to what a user with GPUs gets: ``AcceleratorState`` sees a multi-GPU launch, so
    ``RELABEL["kind"] = "fsdp"`` gives ``DistributedType.FSDP`` with the trainer's FSDP plugin, ``"deepspeed"``
    gives ``DEEPSPEED`` with its DeepSpeed plugin and ``"tensor_parallel"`` ``MULTI_GPU``, which accelerate's
    ``ParallelismConfig(tp_size=...)`` requires (it refuses ``MULTI_CPU``). The devices stay the CPU."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, mixed_precision=None, cpu=False, *args, **kwargs):
        state = PartialState._shared_state
        if RELABEL["kind"] and state.get("distributed_type") == DistributedType.MULTI_CPU \
                and not AcceleratorState._shared_state:
            state["distributed_type"] = DistributedType.MULTI_GPU
            cpu = False
            if RELABEL["kind"] == "deepspeed":
                os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        original(self, mixed_precision, cpu, *args, **kwargs)

    AcceleratorState.__init__ = __init__


def reset_accelerate():
    """Forget accelerate's singletons between two jobs of one process (the process group stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    RELABEL["kind"] = None
    for name in [n for n in os.environ if n in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
                 or n.startswith("FSDP_")]:  # accelerate's FSDP plugin leaves them set for the next job
        os.environ.pop(name)


# ------------------------------------------------------------------------------------------ gradient capture
class GradientCapture:
    """The full gradient of every trainable parameter at the first optimizer step (before clipping and the update),
    by name: DDP's averaged ``.grad``, FSDP2's sharded gradients gathered, DeepSpeed's partitioned ones through
    ``deepspeed.utils.safe_get_full_grad`` (called between its backward and its step)."""

    def __init__(self):
        self.grads = None

    def record(self, model):
        if self.grads is not None:
            return
        grads = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            grads[_clean(name)] = _full_grad(p)
        self.grads = {k: v for k, v in grads.items() if v is not None}

    def install(self, trainer):
        capture = self
        if trainer.is_deepspeed_enabled:  # accelerate's backward runs the engine's step: capture before it
            from deepspeed.runtime.engine import DeepSpeedEngine

            step = DeepSpeedEngine.step

            def engine_step(engine, *args, **kwargs):
                capture.record(engine.module)
                return step(engine, *args, **kwargs)

            DeepSpeedEngine.step = engine_step
            self.undo = lambda: setattr(DeepSpeedEngine, "step", step)
        else:
            from transformers import TrainerCallback

            class Callback(TrainerCallback):
                def on_pre_optimizer_step(self, args, state, control, **kwargs):
                    capture.record(trainer.model)

            trainer.add_callback(Callback())
            self.undo = lambda: None


def _clean(name):
    for prefix in ("module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def _full_grad(p):
    if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # ZeRO-3; ZeRO-1/2
        from deepspeed.utils import safe_get_full_grad

        g = safe_get_full_grad(p)
    else:
        g = p.grad
    if g is None:
        return None
    if type(g).__name__ == "DTensor":
        g = g.full_tensor()
    return g.detach().double().reshape(-1).tolist()


# ---------------------------------------------------------------------------------------------- layouts
# name: (accelerate's wrapping: TrainingArguments fields, a step before accelerate's FSDP2 wrapping or None)
FSDP_MP64 = "fsdp2_mp"  # a float64 model computing in float32: MixedPrecisionPolicy(param_dtype=float32)


def layout_arguments(layout, world):
    """The ``TrainingArguments`` fields of a layout."""
    if world == 1 or layout == "single":
        return {}
    if layout == "ddp":
        return {"ddp_find_unused_parameters": False}
    if layout == "ddp_unused":
        return {"ddp_find_unused_parameters": True}
    if layout.startswith("fsdp2"):
        reshard = not layout.endswith("_keep")
        return {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": reshard}}
    if layout.startswith("tp"):  # the ranks hold one batch (tensor parallel: no data parallel)
        from accelerate.parallelism_config import ParallelismConfig

        return {"parallelism_config": ParallelismConfig(tp_size=world)}
    if layout.startswith("zero"):
        stage = int(layout[4])
        # stage3_param_persistence_threshold 0: every parameter of the tiny model is partitioned (by default ZeRO-3
        # keeps parameters under 1e5 elements whole, and the head would never be a placeholder)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
        return {"deepspeed": {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                              "zero_allow_untested_optimizer": True}}
    raise ValueError(f"unknown layout {layout!r}")


def wrap_fsdp2(layout):
    """Shape accelerate's FSDP2 wrapping to ``layout`` (it runs ``fsdp2_prepare_model`` in ``Accelerator.prepare``):

    - ``fsdp2``, ``fsdp2_keep``: accelerate's own (each decoder layer, the input embedding, ``[norm, lm_head]``, root)
    - ``fsdp2_head``, ``fsdp2_head_keep``: the LM head alone in its own unit first (``reshard_after_forward`` on /
      off), then accelerate's
    - ``fsdp2_root``: one unit, the root (the head in it), as TRL's ``prepare_fsdp`` wraps reference models
    - ``fsdp2_mp``: the head in its own unit, a float64 model computing in float32
      (``MixedPrecisionPolicy(param_dtype=float32, reduce_dtype=float64)`` for every unit)
    - ``fsdp2_bf16``: the head in its own unit, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
    """
    import accelerate.accelerator
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    original = accelerate.utils.fsdp_utils.fsdp2_prepare_model

    def prepare(accelerator, model):
        plugin = accelerator.state.fsdp_plugin
        if layout == FSDP_MP64:
            plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
        elif layout == "fsdp2_bf16":
            plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mp = plugin.mixed_precision_policy or MixedPrecisionPolicy()
        if layout == "fsdp2_root":
            fully_shard(model, reshard_after_forward=plugin.reshard_after_forward, mp_policy=mp)
            return model
        if layout in ("fsdp2_head", "fsdp2_head_keep", FSDP_MP64, "fsdp2_bf16"):
            fully_shard(model.get_output_embeddings(), reshard_after_forward=plugin.reshard_after_forward,
                        mp_policy=mp)
        return original(accelerator, model)

    accelerate.accelerator.fsdp2_prepare_model = prepare


TENSOR_PARALLEL = ("tp_head", "tp_plan")


def data_parallel(spec, world):
    """The data-parallel degree of a layout: the ranks, except under tensor parallelism (one batch on every rank)."""
    return 1 if spec["layout"] in TENSOR_PARALLEL else world


def load_model(spec, name="model", world=1):
    """A causal LM of the job, tensor parallel as the layout says: ``tp_plan`` loads it with transformers'
    ``tp_plan="auto"`` (every layer sharded, the LM head ``colwise_gather_output``); ``tp_head`` shards its LM head
    alone with torch's ``parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})``
    (and records the degree where accelerate reads it)."""
    from transformers import AutoModelForCausalLM

    layout = spec["layout"]
    if layout == "tp_plan":
        return AutoModelForCausalLM.from_pretrained(model_path(spec, name), dtype="auto", tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(model_path(spec, name), dtype="auto")
    if layout == "tp_head":
        tensor_parallel_lm_head(model, world)
    return model


def tensor_parallel_lm_head(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers.distributed.configuration_utils import DistributedConfig

    init_process_group({})
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    model.config.distributed_config = DistributedConfig(tp_size=world)  # accelerate's get_model_tp_size reads it


def shuffle_alike():
    """TRL 1.16 shuffles each generation batch with ``torch.randperm`` on each process's own RNG stream, as if every
    process were a data-parallel rank: under tensor parallelism (one batch on every rank) the ranks then hold their
    rows in different orders, and every tensor-parallel layer mixes different rows (TRL's own run is off from the
    first step, KL != 0). A tensor-parallel-aware shuffle draws one permutation for the ranks: here rank 0's RNG
    state is broadcast before each shuffle. Returns the undo."""
    import torch.distributed as dist
    from trl.trainer import distillation_trainer, grpo_trainer

    original = grpo_trainer.shuffle_sequence_dict

    def shuffle(seq_dict):
        state = torch.get_rng_state()
        dist.broadcast(state, src=0)
        torch.set_rng_state(state)
        return original(seq_dict)

    modules = (grpo_trainer, distillation_trainer)
    for module in modules:
        module.shuffle_sequence_dict = shuffle
    return lambda: [setattr(module, "shuffle_sequence_dict", original) for module in modules]


def model_path(spec, name="model"):
    """The float64 copy of a model for the reference and the float64 mixed-precision layout."""
    path = spec[name]
    return path + "64" if spec["layout"] in (FSDP_MP64, "reference") else path


# ---------------------------------------------------------------------------------------------- jobs
def common_arguments(spec, out, world):
    layout = spec["layout"]
    args = dict(output_dir=str(out / "trainer"), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                max_steps=spec["steps"], logging_steps=1, save_strategy="no", disable_tqdm=True,
                dataloader_num_workers=0, max_grad_norm=1e9, ddp_timeout=spec.get("timeout", 60), optim="sgd",
                learning_rate=spec.get("lr", 0.05))
    args.update(layout_arguments(layout, world))
    return args


def run(trainer, spec):
    """Train; the logs, the first step's gradients, the time and what wrapped the model."""
    capture = GradientCapture()
    capture.install(trainer)
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        capture.undo()
    seconds = time.perf_counter() - start
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"logs": logs, "grads": capture.grads, "seconds": seconds, "wrapping": describe(trainer)}


def grpo(spec, out, world):
    """``GRPOTrainer``: generation batches of 4 prompts x 4 completions, two passes each (the second off-policy),
    the KL term on."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = common_arguments(spec, out, world)
    init = {"dtype": "auto", "tp_plan": "auto"} if spec["layout"] == "tp_plan" else {"dtype": "auto"}
    args.update(per_device_train_batch_size=spec["batch"] // data_parallel(spec, world), num_generations=4,
                max_completion_length=6, num_iterations=2, epsilon=0.1, beta=0.1, temperature=0.9,
                loss_type=spec.get("loss_type", "dapo"), top_entropy_quantile=spec.get("top_entropy_quantile", 1.0),
                model_init_kwargs=init)
    args = GRPOConfig(**args)  # before the models (the process group of a tensor-parallel layout)
    model = load_model(spec, world=world) if spec["layout"] == "tp_head" else model_path(spec)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_ids, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts(spec["batch"] * spec["steps"], length=4)}))
    return run(trainer, spec)


def rloo(spec, out, world):
    """``RLOOTrainer``: generation batches of 4 prompts x 4 completions, two passes each, a reference model (the KL
    term on); TRL's loss on the log-probs of kltriton's head."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    args = common_arguments(spec, out, world)
    args.update(per_device_train_batch_size=spec["batch"] // data_parallel(spec, world), num_generations=4,
                max_completion_length=6, num_iterations=2, epsilon=0.1, beta=0.1, temperature=0.9,
                model_init_kwargs={"dtype": "auto"})
    trainer = RLOOTrainer(model=model_path(spec), reward_funcs=reward_ids, args=RLOOConfig(**args),
                          train_dataset=Dataset.from_dict({"prompt": prompts(spec["batch"] * spec["steps"], length=4)}))
    return run(trainer, spec)


def offline(spec, out, world):
    """``SFTTrainer``, ``DPOTrainer`` or ``KTOTrainer`` (``spec["trainer"]``) on fixed prompts and completions (no
    generation); DPO and KTO with their reference model. Their heads: kltriton's, asked for every statistic each
    trainer logs."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    n, name = spec["batch"] * spec["steps"], spec["trainer"]
    prompt, chosen, rejected = prompts(n, length=4), prompts(n, seed=1), prompts(n, seed=2)
    data = {"sft": {"prompt": prompt, "completion": chosen},
            "dpo": {"prompt": prompt, "chosen": chosen, "rejected": rejected},
            "kto": {"prompt": prompt, "completion": chosen, "label": [i % 2 == 0 for i in range(n)]}}[name]
    args = common_arguments(spec, out, world)
    args.update(per_device_train_batch_size=spec["batch"] // data_parallel(spec, world), max_length=16,
                model_init_kwargs={"dtype": "auto"}, **spec.get("config", {}))
    args = getattr(trl, f"{name.upper()}Config")(**args)
    trainer = getattr(trl, f"{name.upper()}Trainer")(model=model_path(spec), args=args,
                                                     train_dataset=Dataset.from_dict(data),
                                                     processing_class=AutoTokenizer.from_pretrained(spec["model"]))
    return run(trainer, spec)


def gkd(spec, out, world):
    """``GKDTrainer`` on fixed completions (``lmbda=0``: no generation), a wider teacher."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    args = common_arguments(spec, out, world)
    args.update(per_device_train_batch_size=spec["batch"] // data_parallel(spec, world), lmbda=0.0, beta=0.3)
    args = GKDConfig(**args)  # before the models: under ZeRO-3 they are built partitioned
    student, teacher = load_model(spec, world=world), load_model(spec, "teacher", world=world)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    texts = [p + " " + c for p, c in zip(prompts(spec["batch"] * spec["steps"], length=4),
                                          prompts(spec["batch"] * spec["steps"], seed=1))]
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, processing_class=tok,
                         train_dataset=Dataset.from_dict({"text": texts}), data_collator=collate_completions(tok))
    return run(trainer, spec)


def collate_completions(tok):
    """Right-padded ``input_ids`` / ``attention_mask`` and ``labels`` that score the words after the first four."""
    def collate(examples):
        batch = tok([e["text"] for e in examples], padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, :4] = -100
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}
    return collate


def distillation(spec, out, world):
    """``DistillationTrainer``: on-policy completions (the deterministic ``generate``), a wider teacher."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    args = common_arguments(spec, out, world)
    init = {"dtype": "auto", "tp_plan": "auto"} if spec["layout"] == "tp_plan" else {"dtype": "auto"}
    args.update(per_device_train_batch_size=spec["batch"] // data_parallel(spec, world), max_completion_length=6,
                beta=0.3, temperature=0.9, model_init_kwargs=init)
    args = DistillationConfig(**args)
    teacher = load_model(spec, "teacher", world=world)
    data = Dataset.from_dict({"prompt": prompts(spec["batch"] * spec["steps"], length=4)})
    model = load_model(spec, world=world) if spec["layout"] == "tp_head" else model_path(spec)
    trainer = DistillationTrainer(model=model, teacher_model=teacher, args=args, train_dataset=data)
    return run(trainer, spec)


# ----------------------------------------------------------------------------------------------- verl on CPU
VARLEN = "kltriton_test_varlen"


def verl_on_cpu():
    """verl 0.9.1 knows CUDA / NPU / ROCm platforms only and runs packed sequences (and Ulysses) through flash
    attention. On CPU: a CPU platform, and a packed-sequence attention registered with transformers under
    ``VARLEN`` (transformers' flash-attention wrapper around causal SDPA per sequence, the sequences found from the
    position ids as flash attention's varlen path finds them), so verl's Ulysses all-to-all wraps it as it wraps
    flash attention. verl's value-head patch imports a TRL model that TRL 1.16 no longer has: switched off (the
    actor is a causal LM)."""
    import contextlib

    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    from verl.models.transformers import monkey_patch
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):
        device_name, vendor_name, device_module = "cpu", "cpu", torch.cpu

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    platform_manager.set_platform(CPUPlatform())
    monkey_patch.is_trl_available = lambda: False
    monkey_patch._flash_attention_forward = varlen_attention  # what verl's Ulysses wrapper calls inside
    flash_attention._flash_attention_forward = varlen_attention  # without Ulysses
    AttentionInterface.register(VARLEN, flash_attention.flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


def varlen_attention(query, key, value, attention_mask, query_length, *args, position_ids=None, is_causal=True,
                     softmax_scale=None, **kwargs):
    """Flash attention's varlen forward on CPU: ``[1, N, heads, dim]`` packed sequences, each starting where its
    position id is 0, causal SDPA inside each."""
    n = query.shape[1]
    starts = (position_ids.reshape(-1)[:n] == 0).cumsum(0)
    same = starts[:, None] == starts[None, :]
    mask = same & torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2)


def init_process_group(spec):
    """The gloo group of a job that no trainer starts, with the job's short timeout."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 60)))


def sequences(n, seed=3):
    """``n`` token sequences of 5 to 13 tokens and their loss masks (the tokens after the first three)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, VOCAB, (5 + (7 * i) % 9,), generator=gen) for i in range(n)]
    masks = [torch.arange(len(t)) >= 3 for t in ids]
    return ids, masks


def verl_reference(spec):
    """Per-sequence log-probs of the next token and entropies at temperature ``T``, and the gradient of verl's
    ``sft_loss`` over the whole batch, from a float64 transformers model in one process (no verl, no kltriton)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"] + "64", dtype="auto", attn_implementation="eager")
    ids, masks = sequences(spec["sequences"])
    T = spec["temperature"]
    logps, entropies, total, count = [], [], 0.0, 0
    for seq, mask in zip(ids, masks):
        logits = model(input_ids=seq[None]).logits[0] / T
        logp = logits.log_softmax(-1)
        logps.append(logp[:-1].gather(-1, seq[1:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
        total = total - (logps[-1] * mask[1:]).sum()
        count += int(mask[1:].sum())
    (total / count).backward()
    grads = {name: p.grad.reshape(-1).tolist() for name, p in model.named_parameters()}
    return {"logps": [t.tolist() for t in logps], "entropy": [t.detach().tolist() for t in entropies],
            "grads": grads, "seconds": 0.0}


def verl_engine(spec, out, world):
    """verl's FSDP engine (``FSDPEngineWithLMHead``, FSDP2) on this rank's sequences: the log-probs and entropies of
    ``infer_batch``, and the gradient of one ``forward_backward_batch`` with verl's ``sft_loss``. ``layout``:
    ``fsdp2`` (data parallel over the ranks, each rank half the sequences) or ``ulysses`` (one data-parallel group,
    every sequence split over the ranks by Ulysses sequence parallelism). ``fused``: verl's ``use_fused_kernels``
    with ``impl_backend="kltriton"`` (the log-probs from the hidden states, in the model's forward); else verl's
    logits path (its ``logprobs_from_logits`` / ``entropy_from_logits``, which ``apply()`` sends to kltriton)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if spec["layout"] == "reference":
        return verl_reference(spec)
    if spec.get("roll_locally"):  # the control: what verl did before #6068, labels rolled on each rank's slice
        original = FSDPEngineWithLMHead.prepare_model_inputs

        def prepare_model_inputs(self, micro_batch):
            model_inputs, output_args = original(self, micro_batch)
            model_inputs.pop("shift_labels", None)
            return model_inputs, output_args

        FSDPEngineWithLMHead.prepare_model_inputs = prepare_model_inputs
        try:
            return verl_run(spec, world)
        finally:
            FSDPEngineWithLMHead.prepare_model_inputs = original
    return verl_run(spec, world)


def verl_run(spec, world):
    """One engine's run; verl switches the model class's forward to its backend's (a class attribute, for every
    later model of the process): put back afterwards."""
    from transformers import LlamaForCausalLM

    forward = LlamaForCausalLM.forward
    try:
        return verl_engine_run(spec, world)
    finally:
        LlamaForCausalLM.forward = forward


def verl_engine_run(spec, world):
    import functools

    from tensordict import TensorDict
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import sft_loss

    init_process_group(spec)
    rank = int(os.environ.get("RANK", "0"))
    sp = world if spec["layout"] == "ulysses" else 1
    fused = spec.get("fused", True)
    model_config = HFModelConfig(path=spec["model"], use_fused_kernels=fused, enable_gradient_checkpointing=False,
                                 fused_kernel_options={"impl_backend": "kltriton"},
                                 override_config={"attn_implementation": VARLEN})
    engine_config = FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=sp, use_torch_compile=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"})
    engine = FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=0.0), CheckpointConfig())
    engine.initialize()
    ids, masks = sequences(spec["sequences"])
    mine = list(range(len(ids))) if sp > 1 else list(range(rank, len(ids), world))

    def batch():
        nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
        data = TensorDict({"input_ids": nested([ids[i] for i in mine]),
                           "position_ids": nested([torch.arange(len(ids[i])) for i in mine]),
                           "loss_mask": nested([masks[i].long() for i in mine])}, batch_size=[len(mine)])
        tu.assign_non_tensor(data, temperature=spec["temperature"], use_remove_padding=True, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=2, use_fused_kernels=fused, calculate_entropy=True)
        return data

    start = time.perf_counter()
    with engine.eval_mode():
        output = engine.infer_batch(batch())["model_output"]
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(batch(), functools.partial(sft_loss, None))
        grads = {_clean(name): _full_grad(p) for name, p in engine.module.named_parameters()}
    seconds = time.perf_counter() - start
    logps = [t[:-1].tolist() for t in output["log_probs"].unbind()]  # the last: rolled onto the next sequence
    entropy = [t.tolist() for t in output["entropy"].unbind()]
    return {"sequences": mine, "logps": logps, "entropy": entropy, "grads": grads, "seconds": seconds,
            "wrapping": {"wrapper": type(engine.module).__name__, "ulysses": sp}}


# ------------------------------------------------------------------------------------------------- OpenRLHF
def actor_batch(rank, world):
    """This rank's rows of 8 sequences of 14 tokens (the first rows left-padded, as OpenRLHF pads prompts), their
    action masks over the last 6 tokens (responses of 2 to 6 tokens), advantages and old log-probs' offsets."""
    gen = torch.Generator().manual_seed(5)
    sequences = torch.randint(3, VOCAB, (8, 14), generator=gen)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :3] = attention_mask[5, :2] = 0
    action_mask = torch.arange(6)[None, :] < torch.tensor([6, 4, 5, 2, 3, 6, 4, 5])[:, None]
    advantages = torch.randn(8, 6, generator=gen)
    offsets = 0.3 * torch.randn(8, 6, generator=gen)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return [t[rows] for t in (sequences, attention_mask, action_mask, advantages, offsets)], int(action_mask.sum())


def openrlhf_actor(spec, out, world):
    """OpenRLHF's ``Actor`` (temperature 0.7) under DeepSpeed ZeRO-3 (``layout="zero3"``, every parameter
    partitioned) or alone in float64 (``"reference"``): the action log-probs without gradient (as the experience
    maker scores), then one training step's log-probs, entropy and OpenRLHF's ``PolicyLoss`` (normalized by the
    global token count), and the parameter gradients before the step."""
    from openrlhf.models import Actor, PolicyLoss
    from transformers import AutoModelForCausalLM

    reference = spec["layout"] == "reference"
    world = spec.get("ranks", 2)  # the reference plays each of the sharded run's ranks in turn
    if not reference:
        init_process_group(spec)
    rank = int(os.environ.get("RANK", "0"))
    model = AutoModelForCausalLM.from_pretrained(model_path(spec), dtype="auto", attn_implementation="sdpa")
    actor = Actor(model, temperature=0.7)
    actor.packing_samples = False  # Actor sets it only when it loads the model itself
    ranks = range(world) if reference else [rank]
    start = time.perf_counter()
    if reference:
        engine = actor
    else:
        import deepspeed

        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1,
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        engine, *_ = deepspeed.initialize(model=actor, optimizer=torch.optim.SGD(actor.parameters(), lr=0.0),
                                          config=config)
    loss_fn = PolicyLoss()
    old, logps, entropies, loss_total = [], [], [], 0.0
    for r in ranks:
        (sequences, attention_mask, action_mask, advantages, offsets), count = actor_batch(r, world)
        with torch.no_grad():
            old_logp = engine(sequences, action_mask, attention_mask)
        logp, output = engine(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)
        loss, *_ = loss_fn(logp, old_logp.detach() + offsets.to(logp.dtype), advantages.to(logp.dtype),
                           action_mask=action_mask, dp_size=world, batch_num_tokens=count)
        if reference:
            (loss / world).backward()  # the ranks' mean, as ZeRO averages their gradients
        else:
            engine.backward(loss)
        old.append(old_logp.tolist())
        logps.append(logp.tolist())
        entropies.append(output.entropy[:, -6:].tolist())
        loss_total += float(loss) / world
    grads = {_clean(n).removeprefix("model."): _full_grad(p) for n, p in actor.named_parameters()}
    if not reference:
        engine.step()
    return {"ranks": list(ranks), "old": old, "logps": logps, "entropy": entropies, "loss": loss_total,
            "grads": grads, "seconds": time.perf_counter() - start}


# ------------------------------------------------------------------------------------------- kltriton.heads
def heads_job(spec, out, world):
    """``kltriton.heads`` in a loop of one's own: a tiny Llama wrapped by ``layout`` (``fsdp2_head``: the head in its
    own FSDP2 unit; ``fsdp2_root``: one unit; ``zero3``: a DeepSpeed ZeRO-3 engine; ``ddp_unused``: DDP with
    ``find_unused_parameters``; ``reference``: float64, one process, every rank's rows in turn). Each rank scores its
    rows: ``run_in_forward`` + ``score_with_lm_head`` give the loss (mean log-prob of the next tokens) and its
    gradients; ``lm_head_logits`` under ``no_grad`` gives the head as a gathered copy; for a trainable sharded head
    outside the forward it must raise."""
    import kltriton
    from kltriton import heads
    from transformers import AutoModelForCausalLM

    reference = spec["layout"] == "reference"
    ranks = spec.get("ranks", 2)
    if not reference:
        init_process_group(spec)
    rank = int(os.environ.get("RANK", "0"))
    model = AutoModelForCausalLM.from_pretrained(model_path(spec), dtype="auto", attn_implementation="eager")
    full_head = model.lm_head.weight.detach().clone()
    wrapped = wrap_plain(model, spec["layout"])
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (4, 9), generator=gen)
    start = time.perf_counter()

    def loss_of(rows):
        def forward(input_ids):  # the model's forward: backbone, then the loss inside the head's forward
            hidden = model.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
            if rank == spec.get("fail_rank"):  # a rank that fails before the head's collectives
                if spec.get("linger"):  # and stays alive (its sockets open) for that long, as a caught error would
                    print(f"[{time.time() - T0:.1f}s] rank {rank} fails on purpose and lingers", file=sys.stderr,
                          flush=True)
                    time.sleep(spec["linger"])
                raise ValueError(f"rank {rank} fails on purpose")
            return heads.score_with_lm_head(model, hidden, lambda logits: kltriton.token_logprobs(
                logits, input_ids[:, 1:], temperature=0.8).mean())
        return -heads.run_in_forward(wrapped, forward, ids[rows])

    my_ranks = range(ranks) if reference else [rank]
    losses = []
    for r in my_ranks:
        loss = loss_of(slice(r * 4 // ranks, (r + 1) * 4 // ranks))
        (loss / len(my_ranks)).backward() if reference else backward(wrapped, loss)
        losses.append(float(loss))
    grads = {_clean(n): _full_grad(p) for n, p in model.named_parameters()}
    if spec["layout"] == "zero3":
        wrapped.step()
    raised = None
    if not reference and spec["layout"] != "ddp_unused":
        try:
            heads.lm_head_logits(wrapped, torch.zeros(1, model.config.hidden_size))
        except RuntimeError as err:
            raised = str(err)
    with torch.no_grad():
        copy = heads.lm_head_logits(wrapped, torch.zeros(1, model.config.hidden_size)).weight
    return {"losses": losses, "grads": grads, "raised": raised, "seconds": time.perf_counter() - start,
            "copy_equal": bool(torch.equal(copy.to(full_head.dtype), full_head)), "copy_shape": list(copy.shape)}


def wrap_plain(model, layout):
    """``model`` wrapped by ``layout`` outside any trainer."""
    if layout == "reference":
        return model
    if layout == "ddp_unused":
        return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if layout.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        if layout == "fsdp2_head":
            fully_shard(model.lm_head)
            for layer in model.model.layers:
                fully_shard(layer)
        fully_shard(model)
        return model
    if layout == "zero3":
        import deepspeed

        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=config)
        return engine
    raise ValueError(layout)


def backward(wrapped, loss):
    if hasattr(wrapped, "backward"):  # a DeepSpeed engine
        wrapped.backward(loss)
    else:
        loss.backward()


def tensor_parallel_head(spec, out, world):
    """The plug-in point for kltriton's DTensor front door: a head made tensor parallel by torch's
    ``parallelize_module`` (``ColwiseParallel``: a ``Shard(0)`` weight, as transformers' ``tp_plan`` shards
    ``lm_head``). ``lm_head_logits`` hands the ``DTensor`` weight over as it is, with the hidden states as a
    ``Replicate`` ``DTensor`` on its mesh."""
    from kltriton import heads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    init_process_group(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype="auto")
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
    logits = heads.lm_head_logits(model, torch.zeros(3, model.config.hidden_size))
    return {"weight": [str(p) for p in logits.weight.placements], "hidden": [str(p) for p in logits.hidden.placements],
            "weight_local": list(logits.weight.to_local().shape), "shape": list(logits.shape), "seconds": 0.0}


def heads_2d(spec, out, world):
    """FSDP2 and tensor parallelism together, a 2-D mesh ``(dp, tp) = (2, 2)`` on 4 ranks: the LM head tensor
    parallel (``parallelize_module`` with ``ColwiseParallel(output_layouts=Replicate())`` over ``tp``), then every
    decoder layer, the head and the root ``fully_shard`` over ``dp``; each ``dp`` rank scores its rows with
    ``run_in_forward`` + ``score_with_lm_head`` (vocab-parallel over ``tp`` inside the head unit's forward). Against
    the float64 model (every ``dp`` rank's rows in turn, the mean): the loss of this rank's rows and the largest
    relative difference of every parameter's full gradient."""
    import kltriton
    from kltriton import heads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    init_process_group(spec)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype="auto")
    reference = AutoModelForCausalLM.from_pretrained(spec["model"] + "64", dtype="auto")
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    fully_shard(model.lm_head, mesh=mesh["dp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ids = torch.randint(3, VOCAB, (4, 9), generator=torch.Generator().manual_seed(7))
    start = time.perf_counter()

    def loss_of(m, input_ids):
        def forward(input_ids):
            hidden = m.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
            return heads.score_with_lm_head(m, hidden, lambda logits: kltriton.token_logprobs(
                logits, input_ids[:, 1:], temperature=0.8).mean())
        return -heads.run_in_forward(m, forward, input_ids)

    loss = loss_of(model, ids[2 * dp:2 * dp + 2])
    loss.backward()
    expected = [loss_of(reference, ids[2 * r:2 * r + 2]) for r in range(2)]
    (sum(expected) / 2).backward()
    grads = {}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        g = p.grad.full_tensor() if type(p.grad).__name__ == "DTensor" else p.grad
        grads[name] = ((g.double() - q.grad).abs().max() / q.grad.abs().max()).item()
    return {"loss": float(loss), "expected": float(expected[dp]), "grads": grads,
            "placements": [str(p) for p in model.lm_head.weight.placements], "seconds": time.perf_counter() - start}


def describe(trainer):
    """What wraps the trained model: accelerate's distributed type, the wrapper, the FSDP2 units, ZeRO's stage."""
    from torch.distributed.fsdp import FSDPModule

    model = trainer.model_wrapped
    units = [name or "<root>" for name, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    return {"distributed_type": str(trainer.accelerator.distributed_type), "wrapper": type(model).__name__,
            "fsdp_units": units, "zero_stage": stage}


JOBS = {"grpo": grpo, "rloo": rloo, "offline": offline, "gkd": gkd, "distillation": distillation, "verl": verl_engine, "openrlhf": openrlhf_actor,
        "heads": heads_job, "tensor_parallel": tensor_parallel_head, "heads_2d": heads_2d}


def integration(job):
    from kltriton.integrations import openrlhf, trl, verl

    return {"verl": verl, "openrlhf": openrlhf}.get(job, trl)


COUNTED = ("token_logprobs", "token_kl", "token_divergence", "policy_loss")


def count_kltriton_calls():
    """Count the calls of kltriton's public functions (in ``kltriton`` and every kltriton module that imported them
    by name); returns the counter, a dict by function name."""
    import kltriton

    calls = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        original = getattr(kltriton, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        for module_name, module in list(sys.modules.items()):
            if module_name.split(".")[0] == "kltriton" and getattr(module, name, None) is original:
                setattr(module, name, counted)
    return calls


def count_logits():
    """Count the module outputs that are logits (a tensor whose last dimension is the vocabulary): kltriton's paths
    build none, not even a vocabulary shard's. Returns the counter (a one-entry list) and the hook's handle."""
    built = [0]

    def hook(module, args, output):
        output = getattr(output, "logits", output)
        if isinstance(output, torch.Tensor) and output.dim() >= 2 and output.shape[-1] in (VOCAB, (VOCAB + 1) // 2,
                                                                                          VOCAB // 2):
            built[0] += 1

    return built, torch.nn.modules.module.register_module_forward_hook(hook)


class Lines(logging.Handler):
    """The kltriton log lines of a job (what runs: kltriton's head / loss, or a library's fallback and why)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(path):
    scenario = json.loads(Path(path).read_text())
    out = Path(scenario["out"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    logging.getLogger("kltriton").setLevel(logging.WARNING)
    print(f"[{time.time() - T0:.1f}s] rank {rank} start", file=sys.stderr, flush=True)
    from transformers import GenerationMixin

    GenerationMixin.generate = fake_generate
    relabel_accelerate()
    from kltriton.integrations import openrlhf, trl, verl  # noqa: F401  (they call kltriton's functions by name)

    calls = count_kltriton_calls()
    if any(spec["layout"].startswith("zero") or spec["job"] in ("openrlhf", "heads") for spec in scenario["jobs"]):
        import deepspeed.ops

        # DeepSpeed's CPU accelerator would compile its shared-memory all-reduce op (minutes, a C++ toolchain) on the
        # first collective; training's collectives go through torch.distributed (gloo) without it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    results = []
    for spec in scenario["jobs"]:
        layout = spec["layout"]
        if world > 1 and (layout.startswith(("fsdp", "zero")) or layout in TENSOR_PARALLEL):
            RELABEL["kind"] = {"f": "fsdp", "z": "deepspeed", "t": "tensor_parallel"}[layout[0]]
        if layout.startswith("fsdp"):
            wrap_fsdp2(layout)
        undo_shuffle = shuffle_alike() if layout in TENSOR_PARALLEL and spec["job"] in ("grpo", "distillation") \
            else None
        lines = Lines()
        logging.getLogger("kltriton").addHandler(lines)
        before = dict(calls)
        logits_built, logits_hook = count_logits()
        patch = None
        if spec["job"] == "verl":
            verl_on_cpu()
        if spec["job"] == "openrlhf":
            sys.path.insert(0, str(Path(__file__).parents[1]))
            from openrlhf_support import stub_flash_attn

            stub_flash_attn()
        if spec.get("kltriton", True) and layout != "reference" and spec["job"] in ("grpo", "rloo", "offline",
                                                                                     "gkd", "distillation", "verl",
                                                                                     "openrlhf"):
            patch = integration(spec["job"]).apply()
        try:
            result = JOBS[spec["job"]](spec, out, world)
        finally:
            if patch is not None:
                patch.undo()
            if undo_shuffle is not None:
                undo_shuffle()
            logging.getLogger("kltriton").removeHandler(lines)
            logits_hook.remove()
            reset_accelerate()
        result.update(job=spec["job"], name=spec.get("name", spec["job"]), layout=layout, lines=lines.lines,
                      calls={k: calls[k] - before[k] for k in calls}, logits_built=logits_built[0])
        print(f"[{time.time() - T0:.1f}s] rank {rank} {spec['job']} {layout} done ({result['seconds']:.1f}s training)",
              file=sys.stderr, flush=True)
        results.append(result)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
