"""Shared by the OpenRLHF tests: importing ``openrlhf.models`` on a machine without flash-attn."""
import importlib.machinery
import sys
import types


def stub_flash_attn():
    """flash-attn is CUDA-only and does not build on a CPU machine, yet ``import openrlhf.models`` imports
    ``flash_attn.bert_padding`` (used only for packed samples and ring attention, which these tests don't use).
    Stand in for those names with functions that fail if called; ``flash_attn.ops`` stays missing, so
    ``log_probs_from_logits`` takes its PyTorch path, as on any machine without flash-attn's Triton kernels.
    Does nothing where flash-attn is installed."""
    try:
        import flash_attn  # noqa: F401
        return
    except ImportError:
        pass

    def unavailable(*args, **kwargs):
        raise RuntimeError("flash_attn stub: not available on this CPU test machine")

    modules = {}
    for name in ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        modules[name] = module
    for attr in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
        setattr(modules["flash_attn.bert_padding"], attr, unavailable)
    modules["flash_attn.utils.distributed"].all_gather = unavailable
    sys.modules.update(modules)
