"""The docs say what the code does: the ``python -m kltriton info`` sample lists every kernel family, the API index
every API page, the install page every extra, the policy_loss page every metric; no install command breaks in zsh; the
README, CONTRIBUTING and the install page make one statement of the test suite's size and time."""
import pathlib
import re

import pytest
import torch

import kltriton
from kltriton import __main__ as cli
from kltriton import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _code_blocks(text):
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)


def test_info_sample_shows_every_family_and_backend_as_the_command_prints_them(capsys):
    install = (DOCS / "install.md").read_text()
    sample = next(block for block in _code_blocks(install) if block.startswith("kltriton "))
    for family, what in dispatch.FAMILIES.items():
        assert re.search(rf"^  {family} +CPU tensors -> \w+   \({re.escape(what)}\)$", sample, re.M), family
    for backend in dispatch.BACKENDS:
        assert re.search(rf"^  {backend} +(yes|no) ", sample, re.M), backend
    assert cli.info() == 0
    headings = [line for line in capsys.readouterr().out.splitlines() if line.endswith(":")]
    assert headings == [line for line in sample.splitlines() if line.endswith(":")]


def test_api_index_links_every_api_page():
    index = (DOCS / "api" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w]+\.md)\)", index))
    pages = {path.name for path in (DOCS / "api").glob("*.md")} - {"index.md"}
    assert pages <= linked, sorted(pages - linked)


def test_install_page_lists_every_extra():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as file:
        extras = set(tomllib.load(file)["project"]["optional-dependencies"])
    install = (DOCS / "install.md").read_text()
    table = install[install.index("## Extras"):install.index("## Trainer integrations")]
    listed = set(re.findall(r"^\| `\[(\w+)\]` \|", table, re.M))
    assert listed == extras
    readme = (ROOT / "README.md").read_text()
    readme_line = readme[readme.index("Dependencies: torch"):readme.index("## One example per op")]
    assert set(re.findall(r"`\[(\w+)\]`", readme_line)) >= extras


def test_one_statement_of_the_suite_everywhere():
    def statement(path):
        paragraph = next(p for p in path.read_text().split("\n\n") if p.startswith("**The test suite**"))
        return " ".join(paragraph.split())

    readme = statement(ROOT / "README.md")
    assert statement(ROOT / "CONTRIBUTING.md") == readme == statement(DOCS / "install.md")


def test_no_unquoted_extras_in_install_commands():
    """``pip install .[triton]`` fails in zsh (the brackets are a glob): every extra is quoted."""
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for line in path.read_text().splitlines():
            assert not re.search(r"pip install[^\"'`]*\s-?e?\s*[\w./-]*\[\w+\]", line), f"{path.name}: {line}"


def _metric_names():
    """Every metric name policy_loss returns, over the options that add metrics."""
    torch.manual_seed(0)
    logits, labels, adv = torch.randn(2, 6, 40), torch.randint(0, 40, (2, 6)), torch.randn(2)
    old = kltriton.token_logprobs(logits + 0.3 * torch.randn_like(logits), labels)
    calls = [dict(), dict(rollout_logprobs=old - 0.1, is_mode="token_truncate"),
             dict(token_mask_entropy_quantile=0.5, entropy_coef=0.01), dict(loss_type="vespo"),
             dict(truncation=kltriton.Truncation(top_k=5))]
    names = set()
    for kwargs in calls:
        names |= set(kltriton.policy_loss(logits, labels, adv, old_logprobs=old, ref=torch.randn(2, 6, 40),
                                          kl_coef=0.1, **kwargs).metrics)
    return names


def test_policy_loss_page_documents_every_metric():
    page = (DOCS / "api" / "policy_loss.md").read_text()
    metrics = page[page.index("- Metrics"):]
    names = _metric_names()
    assert {"pg_loss", "kl_loss", "entropy_loss", "entropy_threshold", "vespo_phi_mean",
            "outside_support_frac"} <= names
    undocumented = sorted(name for name in names if f"`{name}`" not in metrics)
    assert not undocumented


def test_route_docstring_tables_are_the_rules_in_code():
    """``route``'s docstring tables of two-pass rules list ``LOSS_TWO_PASS`` and ``DIVERGENCE_TWO_PASS``, in order."""
    from kltriton import route

    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in route.__doc__.splitlines() if line.startswith("| ") and not line.startswith("| rule ")]
    rules = [[rule.what, rule.why] for rule in route.LOSS_TWO_PASS + route.DIVERGENCE_TWO_PASS]
    assert [row for row in rows if len(row) == 2] == rules
