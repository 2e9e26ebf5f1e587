"""The pip command an error message gives for an optional part of kltriton.

kltriton is on no package index: naming an extra of it (kltriton[trl]) works only where kltriton is already
installed as a distribution (pip then reads the extra from the installed copy), not from a checkout on the path,
and unquoted it is a glob in zsh. So each command names the packages themselves, quoted, with the versions of the
matching extra in ``pyproject.toml`` (``tests/tools/test_install_hints.py`` checks that they agree): it works
however kltriton was installed.
"""
from typing import Optional

# pyproject.toml's [project.optional-dependencies], for the parts an error message can point to.
EXTRAS = {
    "triton": ("triton>=3.6", "numpy"),
    "torchrl": ("torchrl>=0.13.3,<0.15", "tensordict>=0.13,<0.15"),
    "ray": ("ray==2.60.0",),
    "trl": ("trl==1.16.0",),
    "verl": ("verl==0.9.1",),
}

TRAINER_INSTALL_DOCS = 'docs/install.md, "Trainer integrations"'

# Beyond the plain requirement: verl's own pins replace the tensordict torchrl needs; openrlhf has no extra
# (its flash-attn dependency cannot be built under pip's build isolation).
NOTES = {
    "verl": f"its pins downgrade tensordict below what torchrl 0.13/0.14 needs; to keep torchrl: "
            f"{TRAINER_INSTALL_DOCS}",
}
COMMANDS = {
    "openrlhf": 'pip install --no-deps "openrlhf==0.11.2", then the few modules its code paths import '
                f"({TRAINER_INSTALL_DOCS})",
}


def pip_install(name: str, version: Optional[str] = None) -> str:
    """The install command for ``name`` (an extra of ``EXTRAS`` or a key of ``COMMANDS``, with its note); for any
    other package, ``pip install "name==version"``."""
    if name in COMMANDS:
        return COMMANDS[name]
    if name not in EXTRAS:
        return f'pip install "{name}=={version}"' if version else f'pip install "{name}"'
    command = "pip install " + " ".join(f'"{requirement}"' for requirement in EXTRAS[name])
    return f"{command} ({NOTES[name]})" if name in NOTES else command
