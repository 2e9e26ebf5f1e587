"""``python -m kltriton info`` (versions, usable backends) and ``python -m kltriton demo`` (the main job)."""
import platform
import sys


def info() -> int:
    import torch

    from kltriton import __version__, _backends

    print(f"kltriton {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}", end="")
    try:
        import triton

        print(f", triton {triton.__version__}")
    except ImportError:
        print(", triton not installed")
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, threads: {torch.get_num_threads()}")
    cuda = torch.cuda.is_available()
    print(f"cuda: {torch.cuda.get_device_name() if cuda else 'not available'}")
    print("backends:")
    for name in _backends.BACKENDS:
        usable, why = _backends.availability(name)
        print(f"  {name:<10} {'yes' if usable else 'no ':<4} {why}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "info":
        return info()
    if argv[0] == "demo":
        from kltriton.demo import main as demo

        return demo(argv[1:])
    print(f"unknown command {argv[0]!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
