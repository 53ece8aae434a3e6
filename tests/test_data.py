"""Synthetic corpora: determinism, held-out rule, correctness of targets, loader errors."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from rpb.pipeline import data
from rpb.pipeline.data import (
    DOMAIN_TOKENS,
    HELD_OUT_TASKS,
    NOUNS,
    SIZE_PRESETS,
    check_disjoint,
    load_jsonl,
    split_symbols,
    write_corpora,
    write_eval_only_set,
)

TRAIN_FILES = ("pretrain.jsonl", "post/math.jsonl", "post/math2.jsonl")
ARITH = {
    "addition": re.compile(r"^(\d\d)\+(\d\d)=$"),
    "math": re.compile(r"^SumOf(\d\d)And(\d\d)\?$"),
    "math2": re.compile(r"^(?:Add(\d\d)To(\d\d)|(\d\d)Plus(\d\d))!$"),
}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jsonl"))} | {
        "manifest.json": (root / "manifest.json").read_bytes()
    }


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default")
    write_corpora(out, seed=0, sizes=SIZE_PRESETS["default"])
    return out


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smoke")
    write_corpora(out, seed=3, sizes=SIZE_PRESETS["smoke"])
    return out


def _operands(task: str, prompt: str) -> tuple[int, int]:
    groups = [g for g in ARITH[task].match(prompt).groups() if g is not None]
    return int(groups[0]), int(groups[1])


def test_same_seed_byte_identical_different_seed_differs(smoke_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    write_corpora(again, seed=3, sizes=dict(SIZE_PRESETS["smoke"]))
    assert _files(again) == _files(smoke_dir)
    other = tmp_path / "other"
    write_corpora(other, seed=4, sizes=SIZE_PRESETS["smoke"])
    a, b = _files(smoke_dir), _files(other)
    assert a.keys() == b.keys()
    assert all(a[name] != b[name] for name in a)


def test_manifest_matches_files(default_dir: Path) -> None:
    manifest = json.loads((default_dir / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["sizes"] == SIZE_PRESETS["default"]
    assert set(manifest["files"]) == {str(p.relative_to(default_dir)) for p in _jsonl(default_dir)}
    for name, info in manifest["files"].items():
        raw = (default_dir / name).read_bytes()
        assert info["sha256"] == hashlib.sha256(raw).hexdigest()
        assert info["lines"] == raw.count(b"\n")
    sizes = SIZE_PRESETS["default"]
    assert manifest["files"]["pretrain.jsonl"]["lines"] == sizes["pretrain"]
    assert manifest["files"]["post/math2.jsonl"]["lines"] == sizes["math2"]
    assert all(manifest["files"][f"eval/{t}.jsonl"]["lines"] == 200 for t in data.EVAL_TASKS)


def _jsonl(root: Path) -> list[Path]:
    return sorted(root.rglob("*.jsonl"))


def test_pretraining_mixture_and_domains_use_only_their_own_tokens(default_dir: Path) -> None:
    rows = load_jsonl(default_dir / "pretrain.jsonl", ("domain", "text"))
    counts = {d: sum(r["domain"] == d for r in rows) for d in data.PRETRAIN_DOMAINS}
    assert counts == {"addition": 21000, "facts": 15000, "reverse": 6000, "sort": 6000,
                      "grammar": 12000}  # fmt: skip
    for row in rows:
        assert set(split_symbols(row["text"])) <= set(DOMAIN_TOKENS[row["domain"]]), row


def test_domain_token_sets_overlap_only_where_intended() -> None:
    shared = {("addition", "math"), ("addition", "math2"), ("math", "math2"), ("reverse", "sort")}
    names = list(DOMAIN_TOKENS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            common = set(DOMAIN_TOKENS[a]) & set(DOMAIN_TOKENS[b])
            assert bool(common) == ((a, b) in shared), (a, b, common)


def test_targets_are_correct(default_dir: Path) -> None:
    for task in ARITH:
        rows = load_jsonl(default_dir / f"eval/{task}.jsonl", ("prompt", "target"))
        if task != "addition":
            post = load_jsonl(default_dir / f"post/{task}.jsonl", ("prompt", "completion"))
            rows += [{"prompt": r["prompt"], "target": r["completion"]} for r in post]
        for r in rows:
            a, b = _operands(task, r["prompt"])
            assert r["target"] == str(a + b)[::-1]
    for r in load_jsonl(default_dir / "eval/reverse.jsonl", ("prompt", "target")):
        assert r["prompt"] == r["target"][::-1] + "~"
    for r in load_jsonl(default_dir / "eval/sort.jsonl", ("prompt", "target")):
        assert r["target"] == "".join(sorted(r["prompt"][:-1])) and r["prompt"].endswith("^")
    verb = {n: v for nouns, verbs in NOUNS.items() for n, v in zip(nouns, verbs, strict=True)}
    for r in load_jsonl(default_dir / "eval/grammar.jsonl", ("prompt", "target")):
        subject = next(
            s for s in split_symbols(r["prompt"]) if s in verb
        )  # head noun, not attractor
        assert r["target"] == verb[subject] + "."
        assert any(p in r["prompt"] for p in data.PREPOSITIONS)  # eval always has an attractor


def test_facts_are_consistent_and_eval_probes_training_facts(default_dir: Path) -> None:
    colour: dict[str, set[str]] = {}
    for row in load_jsonl(default_dir / "pretrain.jsonl", ("domain", "text")):
        if row["domain"] == "facts":
            name, col = row["text"].split(":")
            colour.setdefault(name, set()).add(col)
    assert len(colour) == SIZE_PRESETS["default"]["facts"]
    assert all(len(c) == 1 for c in colour.values())
    for r in load_jsonl(default_dir / "eval/facts.jsonl", ("prompt", "target")):
        assert colour[r["prompt"][:-1]] == {r["target"]}


def test_held_out_eval_sets_are_disjoint_from_all_training(default_dir: Path) -> None:
    train = [default_dir / f for f in TRAIN_FILES]
    held_out_sets = [default_dir / f"eval/{task}.jsonl" for task in HELD_OUT_TASKS]
    assert check_disjoint(train, held_out_sets) == 200 * len(HELD_OUT_TASKS)
    # Arithmetic: held-out unordered operand pairs never occur in any training line or format.
    eval_pairs = {}
    for task in ARITH:
        rows = load_jsonl(default_dir / f"eval/{task}.jsonl", ("prompt", "target"))
        eval_pairs[task] = {frozenset(_operands(task, r["prompt"])) for r in rows}
        assert len(eval_pairs[task]) == 200
    assert not eval_pairs["addition"] & eval_pairs["math"]
    assert not (eval_pairs["addition"] | eval_pairs["math"]) & eval_pairs["math2"]
    held_out = set().union(*eval_pairs.values())
    trained = set()
    for row in load_jsonl(default_dir / "pretrain.jsonl", ("domain", "text")):
        if row["domain"] == "addition":
            trained.add(frozenset(_operands("addition", row["text"].split("=")[0] + "=")))
    for task in ("math", "math2"):
        for row in load_jsonl(default_dir / f"post/{task}.jsonl", ("prompt", "completion")):
            trained.add(frozenset(_operands(task, row["prompt"])))
    assert not trained & held_out
    assert len(trained) > 3000  # training still covers most of the 4095 unordered pairs


def test_check_disjoint_names_planted_overlap(smoke_dir: Path, tmp_path: Path) -> None:
    evals = load_jsonl(smoke_dir / "eval/reverse.jsonl", ("prompt", "target"))
    leaky = tmp_path / "pretrain.jsonl"
    shutil.copy(smoke_dir / "pretrain.jsonl", leaky)
    n_lines = len(leaky.read_text().splitlines())
    with leaky.open("a") as fh:
        fh.write(json.dumps({"domain": "reverse", "text": evals[6]["prompt"] + "x"}) + "\n")
    post = smoke_dir / "post/math.jsonl"
    with pytest.raises(ValueError, match=rf"eval/reverse\.jsonl:7: .*{leaky}:{n_lines + 1}$"):
        check_disjoint([post, leaky], smoke_dir / "eval/reverse.jsonl")
    # Among several eval files, the leak is named in its own file.
    several = [smoke_dir / f"eval/{task}.jsonl" for task in ("sort", "reverse", "grammar")]
    with pytest.raises(ValueError, match=rf"eval/reverse\.jsonl:7: .*{leaky}:{n_lines + 1}$"):
        check_disjoint([post, leaky], several)


def test_check_disjoint_matches_whole_symbols_only(tmp_path: Path) -> None:
    ev, tr = tmp_path / "ev.jsonl", tmp_path / "tr.jsonl"
    ev.write_text(json.dumps({"prompt": "TheDogNearTheCat", "target": "Barks."}) + "\n")
    tr.write_text(json.dumps({"prompt": "TheDogNearTheCats", "completion": "Barks."}) + "\n")
    assert check_disjoint([tr], ev) == 1  # "Cats" is one token: not the eval context
    tr.write_text(json.dumps({"text": "TheDogNearTheCatBarks."}) + "\n")
    with pytest.raises(ValueError, match=r"ev\.jsonl:1: .*tr\.jsonl:1"):
        check_disjoint([tr], ev)


def test_eval_sets_do_not_depend_on_training_sizes(tmp_path: Path) -> None:
    small = dict(SIZE_PRESETS["smoke"], pretrain=3000, math=500)
    write_corpora(tmp_path / "a", seed=5, sizes=SIZE_PRESETS["smoke"])
    write_corpora(tmp_path / "b", seed=5, sizes=small)
    for task in data.EVAL_TASKS:
        name = f"eval/{task}.jsonl"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a", "target": "b"}\n{"prompt": "a", \n', r"bad\.jsonl:2: malformed JSON"),
        ('{"prompt": "a", "target": "b"}\n{"prompt": "a"}\n', r"bad\.jsonl:2: missing key.*target"),
        ('{"prompt": "a", "target": 28}\n', r"bad\.jsonl:1: key.*'target'.* strings"),
        ('["a", "b"]\n', r"bad\.jsonl:1: expected a JSON object"),
        ('{"prompt": "a", "target": "b"}\n\n', r"bad\.jsonl:2: malformed JSON"),
        ("", r"bad\.jsonl: empty file"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_jsonl(path, ("prompt", "target"))


def test_invalid_utf8_in_a_jsonl_names_file_and_line(tmp_path: Path) -> None:
    """Issue 47: a text-mode reader's UnicodeDecodeError named neither file nor line."""
    path = tmp_path / "latin1.jsonl"
    good = b'{"prompt": "a", "target": "b"}\n'
    path.write_bytes(good * 2 + '{"prompt": "caf\u00e9", "target": "b"}\n'.encode("latin-1"))
    with pytest.raises(ValueError) as raised:
        load_jsonl(path, ("prompt", "target"))
    assert str(raised.value) == (
        f"{path}:3: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"
    )


def test_bad_sizes_and_mixture_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown corpus size key.*'pretrian'"):
        write_corpora(tmp_path, seed=0, sizes={"pretrian": 10})
    with pytest.raises(ValueError, match="'math' must be a positive int"):
        write_corpora(tmp_path, seed=0, sizes={"math": 0})
    with pytest.raises(ValueError, match=r"unknown mixture domain.*'poetry'"):
        write_corpora(tmp_path, seed=0, sizes=SIZE_PRESETS["smoke"], mixture={"poetry": 1.0})
    with pytest.raises(ValueError, match=r"domain\(s\) \['facts'\] get no lines"):
        mixture = dict(data.MIXTURE, facts=0.0)
        write_corpora(tmp_path, seed=0, sizes=SIZE_PRESETS["smoke"], mixture=mixture)
    with pytest.raises(ValueError, match="unknown symbol ' '"):
        split_symbols("35 +47=")
    assert not list(tmp_path.iterdir())  # nothing written on bad input


def _pairs(path: Path) -> set[frozenset[int]]:
    out = set()
    for rec in load_jsonl(path, ("prompt",)):
        out.add(frozenset(int(x) for x in re.findall(r"\d+", rec["prompt"])))
    return out


def test_dev_split_is_disjoint_from_training_and_eval(default_dir: Path) -> None:
    for task in ("math", "math2"):
        dev = _pairs(default_dir / "dev" / f"{task}.jsonl")
        assert len(dev) == SIZE_PRESETS["default"]["dev"]
        for name in ("addition", "math", "math2"):
            assert not dev & _pairs(default_dir / "eval" / f"{name}.jsonl"), (task, name)
        for train in ("post/math.jsonl", "post/math2.jsonl"):
            assert not dev & _pairs(default_dir / train), (task, train)
        pretrain = {
            frozenset(map(int, re.match(r"(\d+)\+(\d+)=", rec["text"]).groups()))
            for rec in load_jsonl(default_dir / "pretrain.jsonl", ("text",))
            if rec["domain"] == "addition"
        }
        assert not dev & pretrain, task


@pytest.mark.parametrize("level", [2, 3, 4])
def test_levels_change_the_post_tasks_digits_not_pretraining(
    smoke_dir: Path, tmp_path: Path, level: int
) -> None:
    out = tmp_path / f"L{level}"
    manifest = write_corpora(out, seed=3, sizes=SIZE_PRESETS["smoke"], level=level)
    base = json.loads((smoke_dir / "manifest.json").read_text())
    assert manifest["files"]["pretrain.jsonl"] == base["files"]["pretrain.jsonl"]
    assert manifest["files"]["eval/addition.jsonl"] == base["files"]["eval/addition.jsonl"]
    digits = sorted(data.POST_LEVELS[level])
    for name in ("post/math.jsonl", "eval/math.jsonl", "dev/math2.jsonl"):
        for rec in load_jsonl(out / name, ("prompt",)):
            operands = re.findall(r"\d+", rec["prompt"])
            assert sorted(map(len, operands)) == digits, (name, rec)
            target = rec.get("target") or rec["completion"]
            assert target == str(sum(map(int, operands)))[::-1]


def test_unknown_level_and_too_many_held_out_pairs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown difficulty level 9"):
        write_corpora(tmp_path, seed=0, sizes=SIZE_PRESETS["smoke"], level=9)
    with pytest.raises(ValueError, match="'dev'=400"):
        write_corpora(tmp_path, seed=0, sizes=SIZE_PRESETS["default"] | {"dev": 400})


def test_a_cut_post_training_set_is_a_prefix_with_the_same_held_out_items(
    smoke_dir: Path, tmp_path: Path
) -> None:
    """Rule 2's data-limited task (docs/records/regime_walk.md): fewer post-training pairs, same
    stream, same dev and eval sets, same pretraining corpus."""
    cut = data.preset_sizes("smoke", 50)
    assert (
        cut["math"] == cut["math2"] == 50 and cut["pretrain"] == SIZE_PRESETS["smoke"]["pretrain"]
    )
    write_corpora(tmp_path, seed=3, sizes=cut)
    full, small = _files(smoke_dir), _files(tmp_path)
    for task in ("math", "math2"):
        lines = small[f"post/{task}.jsonl"].splitlines()
        assert len(lines) == 50
        assert full[f"post/{task}.jsonl"].splitlines()[:50] == lines
    assert {k: v for k, v in full.items() if k.startswith(("eval/", "dev/", "pretrain"))} == {
        k: v for k, v in small.items() if k.startswith(("eval/", "dev/", "pretrain"))
    }
    with pytest.raises(ValueError, match="corpus size 'math' must be a positive int, got 0"):
        data.preset_sizes("smoke", 0)
    with pytest.raises(ValueError, match="unknown size preset 'tiny'"):
        data.preset_sizes("tiny")


@pytest.mark.parametrize("holdout", ["corner50", "below70"])
def test_a_holdout_removes_its_region_from_post_training_only(
    smoke_dir: Path, tmp_path: Path, holdout: str
) -> None:
    """Rule 3's tasks (docs/records/regime_walk.md): no post-training pair of math or math2 lies
    in the held-out region, while dev, eval and pretraining files are byte-identical to the task
    without it, so some dev items lie in the region (the task's hard items by construction)."""
    manifest = write_corpora(tmp_path, seed=3, sizes=SIZE_PRESETS["smoke"], holdout=holdout)
    assert manifest["post_holdout"] == holdout
    full, held = _files(smoke_dir), _files(tmp_path)
    for task in ("math", "math2"):
        pairs = [
            _operands(task, r["prompt"])
            for r in load_jsonl(tmp_path / "post" / f"{task}.jsonl", ("prompt",))
        ]
        assert len(pairs) == SIZE_PRESETS["smoke"][task]
        assert not any(data.held_out_by(holdout, a, b) for a, b in pairs)
        every = [
            _operands(task, r["prompt"])
            for r in load_jsonl(smoke_dir / "post" / f"{task}.jsonl", ("prompt",))
        ]
        assert any(data.held_out_by(holdout, a, b) for a, b in every)  # the region is not empty
    assert {k: v for k, v in full.items() if k.startswith(("eval/", "dev/", "pretrain"))} == {
        k: v for k, v in held.items() if k.startswith(("eval/", "dev/", "pretrain"))
    }
    dev = [
        _operands("math", r["prompt"])
        for r in load_jsonl(tmp_path / "dev" / "math.jsonl", ("prompt",))
    ]
    assert any(data.held_out_by(holdout, a, b) for a, b in dev)
    assert "post_holdout" not in json.loads(full["manifest.json"])  # earlier manifests unchanged


def test_holdout_regions_and_bad_specs() -> None:
    assert data.held_out_by("corner50", 50, 99) and not data.held_out_by("corner50", 49, 99)
    assert data.held_out_by("below50", 10, 50) and not data.held_out_by("below50", 49, 49)
    assert not data.held_out_by(None, 99, 99)
    for bad in ("corner5", "corner100", "edge50", "corner10", 50):
        with pytest.raises(
            ValueError, match=r"post-training hold-out must be None or corner\|below"
        ):
            data.check_holdout(bad)
    with pytest.raises(ValueError, match="needs level 1"):
        write_corpora(
            Path("/nonexistent"), seed=0, sizes=SIZE_PRESETS["smoke"], level=2, holdout="corner50"
        )


def test_an_eval_only_set_is_written_beside_the_corpora_and_leaves_them_alone(
    tmp_path: Path,
) -> None:
    """`addition3` (rpb.specs.EVAL_SETS["eval_only"]): the corpora's seed and eval size, 3-digit
    operands in the pretraining format, byte-identical when written again, and the corpora,
    their manifest and so every base untouched."""
    write_corpora(tmp_path, seed=3, sizes=SIZE_PRESETS["smoke"])
    corpora = _files(tmp_path)
    path = write_eval_only_set(tmp_path, "addition3")
    assert path == tmp_path / "eval" / "addition3.jsonl"
    records = load_jsonl(path, ("prompt", "target"))
    assert len(records) == SIZE_PRESETS["smoke"]["eval"]
    for record in records:
        a, b = map(int, re.fullmatch(r"(\d{3})\+(\d{3})=", record["prompt"]).groups())
        assert record["target"] == str(a + b)[::-1]  # the pretraining format: sum reversed
    written = path.read_bytes()
    assert write_eval_only_set(tmp_path, "addition3").read_bytes() == written
    assert {k: v for k, v in _files(tmp_path).items() if k != "eval/addition3.jsonl"} == corpora
    with pytest.raises(ValueError, match=r"unknown eval-only set 'addition4' \(known: addition3"):
        write_eval_only_set(tmp_path, "addition4")


def test_an_eval_only_prompt_that_training_saw_names_both_lines(tmp_path: Path) -> None:
    write_corpora(tmp_path, seed=3, sizes=SIZE_PRESETS["smoke"])
    prompt = json.loads(write_eval_only_set(tmp_path, "addition3").read_text().splitlines()[4])
    pretrain = tmp_path / "pretrain.jsonl"
    lines = pretrain.read_text().splitlines()
    lines[1] = json.dumps({"text": prompt["prompt"] + prompt["target"], "domain": "addition"})
    pretrain.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"eval/addition3\.jsonl:5: .* pretrain\.jsonl:2$"):
        write_eval_only_set(tmp_path, "addition3")
