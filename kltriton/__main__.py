"""``python -m kltriton info`` (versions, what runs here) and ``python -m kltriton demo`` (the main job)."""
import platform
import sys

USAGE = """usage: python -m kltriton {info,demo} [options]

  info    versions, the CPU and CUDA devices, and which backend runs each kernel family here
  demo    the main job: per-token log-probs, KL and KL-shaped rewards of a small causal LM against a
          reference, with kltriton and with eager PyTorch (python -m kltriton demo --help for its options)"""


def info() -> int:
    import torch

    from kltriton import __version__, dispatch

    print(f"kltriton {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}", end="")
    try:
        import triton

        print(f", triton {triton.__version__}")
    except ImportError:
        print(", triton not installed")
    cuda = torch.cuda.is_available()
    print(f"cpu: capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print(f"cuda: {torch.cuda.get_device_name() if cuda else 'no CUDA device'}")
    print("default backend per family (backend=None):")
    for family, what in dispatch.FAMILIES.items():
        on_cuda = f"; CUDA tensors -> {dispatch.resolve(None, family, 'cuda', False)}" if cuda else ""
        print(f"  {family:<10} CPU tensors -> {dispatch.resolve(None, family, 'cpu', False)}{on_cuda}   ({what})")
    print("backends (for every family, unless a line names the families):")
    for name in dispatch.BACKENDS:
        families_by_status = {}
        for family in dispatch.FAMILIES:
            usable, why = dispatch.availability(name, family)
            if usable and name == "triton" and not cuda and not dispatch.triton_interpreted():
                usable, why = False, ("installed, but no CUDA device here; TRITON_INTERPRET=1 runs CPU tensors "
                                      "through its interpreter (for tests, far too slow for work)")
            families_by_status.setdefault((usable, why), []).append(family)
        for (usable, why), families in families_by_status.items():
            named = f"   (families: {', '.join(families)})" if len(families_by_status) > 1 else ""
            print(f"  {name:<10} {'yes' if usable else 'no':<4} {why}{named}")
    return 0


def _shadowed_by_a_folder():
    """The message for ``python -m kltriton`` run where a folder named ``kltriton`` without ``__init__.py`` (the
    clone itself, seen from its parent folder) shadows the installed package, or None. Python then imports that
    folder as an empty namespace package, and every ``from kltriton import ...`` fails."""
    package = sys.modules.get("kltriton")
    if package is None or getattr(package, "__file__", None) is not None:
        return None
    folders = ", ".join(getattr(package, "__path__", [])) or "a folder on sys.path"
    return (f"python -m kltriton: 'kltriton' resolves to the folder {folders}, not to the kltriton package (a folder "
            "without __init__.py, such as the clone seen from its parent folder, shadows the installed package). "
            "Run it from the clone's root (cd kltriton) or from any other folder.")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    shadowed = _shadowed_by_a_folder()
    if shadowed:
        print(shadowed, file=sys.stderr)
        return 1
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "info":
        return info()
    if argv[0] == "demo":
        from kltriton.demo import main as demo

        return demo(argv[1:])
    print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
