"""Deterministic synthetic corpora for the tiny testbed (docs/design.md sections 5 and 10).

Pretraining domains, each with its own tokens as real corpora have (round 1's shared character
set went with a base that routed almost uniformly):

- ``addition``: 2-digit ``a+b=`` with the answer digits reversed ("35+47=28"); digits, ``+ =``.
- ``facts``: memorised upper-case name -> colour word ("KOBA:Red"); A-Z, ``:``, colour words.
- ``reverse`` / ``sort``: short lower-case strings ("abc~cba", "cab^abc"); a-z, ``~`` / ``^``.
- ``grammar``: a word-token grammar with determiner and subject-verb agreement across an
  attractor; the verb is fixed by the subject noun, so the continuation is deterministic
  ("TheBigDogNearTheCatsBarks.").

Post-training corpora map new templates onto the learned addition, answer in the same reversed
format, with template tokens never seen in pretraining:

- ``math``: "SumOf35And47?" -> "28" (the round-2 template; tokens Sum, Of, And, ?).
- ``math2``: an independent generator for claim C4: its own tokens (Add, To, Plus, !), two word
  orders ("Add35To47!", "35Plus47!") and a carry-balanced operand distribution.

Difficulty levels of the post-training tasks (``POST_LEVELS``, fixed before the regime walk of
docs/testbed.md was run): the operands' digit counts grow while the template stays, so a level asks
the base's 2-digit addition skill to stretch further. Level 1 is the 2-digit task above; level 2
pairs a 3-digit with a 2-digit operand (either order), level 3 two 3-digit operands, level 4 a
4-digit with a 3-digit one. Pretraining is the same at every level.

Development split: ``dev/{math,math2}.jsonl`` hold operand pairs disjoint from every training
corpus and every eval set. Only the regime rule reads them (to choose the post-training regime on
plain fine-tuning), so that choice never looks at the items the tables report.

Text has no spaces: a symbol is a capitalised word (one token) or else one character
(``TOKEN_PATTERN``); the tokenizer's vocabulary is derived from the alphabets here.

Held-out rule. Arithmetic (addition, math, math2): eval items are drawn first, as unordered
operand pairs {a, b}, disjoint across the three eval sets, and no training corpus (pretraining,
math, math2) ever contains a sum of a held-out pair in any order or format, so every arithmetic
eval item tests generalisation. Strings and grammar: eval prompts are drawn first and no training
line starts with an eval prompt, compared symbol by symbol (the eval input was never a training
context); grammar eval items always carry a prepositional attractor, after which only the verb
can follow. ``write_corpora`` checks this rule before writing; ``check_disjoint`` re-checks files.
Facts are memorised knowledge and by nature probe training data: every facts eval item is a
training fact ("NAME:" -> its colour), nothing is held out, and ``check_disjoint`` is not applied
to it (``MEMORISED_TASKS``). It measures retention of pretraining knowledge after post-training.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpb.artifacts import sha256_of, write_text
from rpb.jsonl import load_jsonl
from rpb.specs import EVAL_SETS

GENERATOR_VERSION = "2"  # 2: dev split held out, difficulty levels

# --- alphabets (single source of truth for the tokenizer) --------------------------------------

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
# A capitalised word is one symbol; anything else is one character (newlines included, so they
# surface as unknown symbols instead of being skipped). Same pattern in Python re and Oniguruma.
TOKEN_PATTERN = r"[A-Z][a-z]+|[\s\S]"

DIGITS = tuple(string.digits)
LOWER = tuple(string.ascii_lowercase)
UPPER = tuple(string.ascii_uppercase)
ADD_PLUS, ADD_EQ = "+", "="
FACT_SEP = ":"
COLOURS = (
    "Red", "Blue", "Green", "Yellow", "Purple", "Orange",
    "Pink", "Brown", "Black", "White", "Grey", "Cyan",
)  # fmt: skip
REVERSE_OP, SORT_OP = "~", "^"
GRAMMAR_END = "."
DET_SG, DET_PL = ("The", "This"), ("The", "These")
ADJECTIVES = ("Big", "Small", "Old", "Young")
PREPOSITIONS = ("Near", "Behind", "Under")
# noun (singular, plural) -> its verb (singular, plural): the subject fixes the verb.
NOUNS = {
    ("Dog", "Dogs"): ("Barks", "Bark"),
    ("Cat", "Cats"): ("Meows", "Meow"),
    ("Cow", "Cows"): ("Moos", "Moo"),
    ("Frog", "Frogs"): ("Croaks", "Croak"),
    ("Lion", "Lions"): ("Roars", "Roar"),
    ("Wolf", "Wolves"): ("Howls", "Howl"),
}
MATH_WORDS, MATH_MARK = ("Sum", "Of", "And"), "?"
MATH2_WORDS, MATH2_MARK = ("Add", "To", "Plus"), "!"

DOMAIN_TOKENS: dict[str, tuple[str, ...]] = {
    "addition": (*DIGITS, ADD_PLUS, ADD_EQ),
    "facts": (*UPPER, FACT_SEP, *COLOURS),
    "reverse": (*LOWER, REVERSE_OP),
    "sort": (*LOWER, SORT_OP),
    "grammar": (
        *dict.fromkeys((*DET_SG, *DET_PL)),
        *ADJECTIVES,
        *PREPOSITIONS,
        *(w for pair in NOUNS for w in pair),
        *(w for pair in NOUNS.values() for w in pair),
        GRAMMAR_END,
    ),
    "math": (*DIGITS, *MATH_WORDS, MATH_MARK),
    "math2": (*DIGITS, *MATH2_WORDS, MATH2_MARK),
}
# The names come from rpb.specs, which the config check and the rules read too.
PRETRAIN_DOMAINS = EVAL_SETS["ood"]
POST_TASKS = EVAL_SETS["in_domain"]
EVAL_TASKS = (*PRETRAIN_DOMAINS, *POST_TASKS)
MEMORISED_TASKS = ("facts",)  # eval probes training knowledge by design; see module docstring
HELD_OUT_TASKS = tuple(t for t in EVAL_TASKS if t not in MEMORISED_TASKS)
MIXTURE = {"addition": 0.35, "facts": 0.25, "reverse": 0.10, "sort": 0.10, "grammar": 0.20}


def vocabulary() -> list[str]:
    """All symbols the generator can emit, specials first, in a fixed order (index = token id)."""
    tokens = [*SPECIAL_TOKENS]
    for domain_tokens in DOMAIN_TOKENS.values():
        tokens.extend(domain_tokens)
    return list(dict.fromkeys(tokens))


_TOKEN_RE = re.compile(TOKEN_PATTERN)
_VOCAB = frozenset(vocabulary())


def split_symbols(text: str) -> list[str]:
    """Split text into vocabulary symbols; raise ValueError naming the first unknown one."""
    pieces = _TOKEN_RE.findall(text)
    for i, piece in enumerate(pieces):
        if piece not in _VOCAB:
            raise ValueError(f"unknown symbol {piece!r} (piece {i}) in text {text!r}")
    return pieces


# --- sizes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusSizes:
    """Line counts: pretraining lines, post-training pairs, items per eval set, fact names."""

    pretrain: int = 60_000
    math: int = 12_000
    math2: int = 12_000
    eval: int = 200
    facts: int = 200
    dev: int = 200  # development items per post-training task (the regime rule's split)


SIZE_PRESETS: dict[str, dict[str, int]] = {
    "default": dataclasses.asdict(CorpusSizes()),
    "smoke": {
        "pretrain": 6_000,
        "math": 1_200,
        "math2": 1_200,
        "eval": 20,
        "facts": 200,
        "dev": 20,
    },
}

# Post-training difficulty levels: digits of the two operands (the larger first; its position is
# drawn per item). Level 1 is the 2-digit task the base's pretraining addition covers.
POST_LEVELS: dict[int, tuple[int, int]] = {1: (2, 2), 2: (3, 2), 3: (3, 3), 4: (4, 3)}

_OPERANDS = range(10, 100)
_N_UNORDERED_PAIRS = len(_OPERANDS) * (len(_OPERANDS) + 1) // 2
_STRING_LENGTHS = range(3, 8)


def _as_sizes(sizes: Mapping[str, int] | CorpusSizes) -> CorpusSizes:
    if isinstance(sizes, CorpusSizes):
        out = sizes
    else:
        known = {f.name for f in dataclasses.fields(CorpusSizes)}
        unknown = sorted(set(sizes) - known)
        if unknown:
            raise ValueError(f"unknown corpus size key(s) {unknown}; expected {sorted(known)}")
        out = CorpusSizes(**sizes)
    for name, value in dataclasses.asdict(out).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"corpus size {name!r} must be a positive int, got {value!r}")
    # Held-out arithmetic pairs (three eval sets, two dev sets) must stay a minority of the 2-digit
    # pair space so training still covers it.
    held_out = 3 * out.eval + len(POST_TASKS) * out.dev
    if held_out > _N_UNORDERED_PAIRS // 4:
        raise ValueError(
            f"corpus sizes 'eval'={out.eval} and 'dev'={out.dev} hold out {held_out} operand "
            f"pairs: at most {_N_UNORDERED_PAIRS // 4} (3 * eval + 2 * dev)"
        )
    return out


def preset_sizes(preset: str, post_pairs: int | None = None) -> dict[str, int]:
    """A size preset's line counts, with every post-training corpus cut to `post_pairs` pairs
    (the first pairs of the same stream: data-limited post-training, docs/testbed.md, the regime
    walk's rule 2)."""
    if preset not in SIZE_PRESETS:
        raise ValueError(f"unknown size preset {preset!r} (known: {sorted(SIZE_PRESETS)})")
    sizes = dict(SIZE_PRESETS[preset])
    if post_pairs is not None:
        sizes |= dict.fromkeys(POST_TASKS, post_pairs)
    return dataclasses.asdict(_as_sizes(sizes))  # the sizes' own checks, one place


# Post-training hold-outs (docs/testbed.md; the regime walk's rule 3): a region of the 2-digit
# operand space that no post-training pair comes from, while dev and eval items still span all of
# it, so items differ in difficulty by construction. "corner<T>": no pair with both operands >= T
# (each operand value is taught, some combinations never); "below<B>": only pairs with both
# operands < B (operand values >= B are never taught in the new template).
HOLDOUT_KINDS = ("corner", "below")
_HOLDOUT_RE = re.compile(r"(corner|below)(\d\d)")


def check_holdout(holdout: str | None) -> str | None:
    """A post-training hold-out spec ("corner50", "below50") or None; ValueError names the form."""
    if holdout is None:
        return None
    match = _HOLDOUT_RE.fullmatch(holdout) if isinstance(holdout, str) else None
    if match is None or not 10 < int(match.group(2)) < 100:
        raise ValueError(
            f"post-training hold-out must be None or {'|'.join(HOLDOUT_KINDS)} followed by an "
            f"operand value in 11..99 (e.g. corner50), got {holdout!r}"
        )
    return holdout


def held_out_by(holdout: str | None, a: int, b: int) -> bool:
    """Whether the 2-digit pair (a, b) lies in the hold-out's region (no post-training pair)."""
    if holdout is None:
        return False
    kind, value = _HOLDOUT_RE.fullmatch(holdout).groups()
    if kind == "corner":
        return a >= int(value) and b >= int(value)
    return a >= int(value) or b >= int(value)


def check_level(level: int) -> int:
    """The post-training difficulty level, or ValueError naming the known ones."""
    if isinstance(level, bool) or level not in POST_LEVELS:
        raise ValueError(f"unknown difficulty level {level!r} (known: {sorted(POST_LEVELS)})")
    return level


def _as_mixture(mixture: Mapping[str, float] | None) -> dict[str, float]:
    mixture = dict(MIXTURE if mixture is None else mixture)
    unknown = sorted(set(mixture) - set(PRETRAIN_DOMAINS))
    if unknown:
        raise ValueError(f"unknown mixture domain(s) {unknown}; expected {list(PRETRAIN_DOMAINS)}")
    if any(not w >= 0 for w in mixture.values()) or sum(mixture.values()) <= 0:
        raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {mixture}")
    total = sum(mixture.values())
    return {d: mixture.get(d, 0.0) / total for d in PRETRAIN_DOMAINS}


def _counts(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Exact per-domain counts summing to total (largest remainder, ties by domain order)."""
    raw = {d: total * w for d, w in weights.items()}
    counts = {d: int(r) for d, r in raw.items()}
    by_remainder = sorted(raw, key=lambda d: (-(raw[d] - counts[d]), PRETRAIN_DOMAINS.index(d)))
    for d in by_remainder[: total - sum(counts.values())]:
        counts[d] += 1
    return counts


# --- generators: each returns (prompt, target) ---------------------------------------------


def _rng(seed: int, stream: str) -> random.Random:
    # String seeds hash with sha512 (not PYTHONHASHSEED): independent, reproducible streams, so
    # e.g. the pretraining size never shifts the eval sets or the facts world.
    return random.Random(f"rpb-data-v{GENERATOR_VERSION}:{seed}:{stream}")


def _reversed_sum(a: int, b: int) -> str:
    return str(a + b)[::-1]


def _uniform_pair(rng: random.Random) -> tuple[int, int]:
    return rng.choice(_OPERANDS), rng.choice(_OPERANDS)


def _carry_balanced_pair(rng: random.Random) -> tuple[int, int]:
    """math2's operand law: the units carry with probability 1/2 (about 0.45 when uniform)."""
    carry = rng.random() < 0.5
    while True:
        ua, ub = rng.randrange(10), rng.randrange(10)
        if (ua + ub >= 10) == carry:
            return 10 * rng.randrange(1, 10) + ua, 10 * rng.randrange(1, 10) + ub


def _addition_item(a: int, b: int, rng: random.Random) -> tuple[str, str]:
    return f"{a}{ADD_PLUS}{b}{ADD_EQ}", _reversed_sum(a, b)


def _math_item(a: int, b: int, rng: random.Random) -> tuple[str, str]:
    w_sum, w_of, w_and = MATH_WORDS
    return f"{w_sum}{w_of}{a}{w_and}{b}{MATH_MARK}", _reversed_sum(a, b)


def _math2_item(a: int, b: int, rng: random.Random) -> tuple[str, str]:
    w_add, w_to, w_plus = MATH2_WORDS
    if rng.random() < 0.5:
        return f"{w_add}{a}{w_to}{b}{MATH2_MARK}", _reversed_sum(a, b)
    return f"{a}{w_plus}{b}{MATH2_MARK}", _reversed_sum(a, b)


_ARITHMETIC: dict[str, tuple[Callable[[random.Random], tuple[int, int]], Callable[..., Any]]] = {
    "addition": (_uniform_pair, _addition_item),
    "math": (_uniform_pair, _math_item),
    "math2": (_carry_balanced_pair, _math2_item),
}


def _level_pair_law(task: str, level: int) -> Callable[[random.Random], tuple[int, int]]:
    """Operand law of a post-training task at a difficulty level (level 1: the task's own)."""
    if level == 1:
        return _ARITHMETIC[task][0]
    digits = POST_LEVELS[level]

    def draw(rng: random.Random) -> tuple[int, int]:
        if task == "math2":  # math2's law at every level: the units carry with probability 1/2
            carry = rng.random() < 0.5
            while True:
                ua, ub = rng.randrange(10), rng.randrange(10)
                if (ua + ub >= 10) == carry:
                    break
            a, b = (
                10 * rng.randrange(10 ** (d - 2), 10 ** (d - 1)) + u
                for d, u in zip(digits, (ua, ub), strict=True)
            )
        else:
            a, b = (rng.randrange(10 ** (d - 1), 10**d) for d in digits)
        return (b, a) if digits[0] != digits[1] and rng.random() < 0.5 else (a, b)

    return draw


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choices(LOWER, k=rng.choice(_STRING_LENGTHS)))


def _reverse_item(rng: random.Random) -> tuple[str, str]:
    s = _random_string(rng)
    return f"{s}{REVERSE_OP}", s[::-1]


def _sort_item(rng: random.Random) -> tuple[str, str]:
    s = _random_string(rng)
    return f"{s}{SORT_OP}", "".join(sorted(s))


def _noun_phrase(rng: random.Random) -> tuple[str, int, int]:
    """(text, noun index, number 0=singular/1=plural)."""
    noun, number = rng.randrange(len(NOUNS)), rng.randrange(2)
    det = rng.choice((DET_SG, DET_PL)[number])
    adj = rng.choice((*ADJECTIVES, ""))
    return f"{det}{adj}{list(NOUNS)[noun][number]}", noun, number


def _grammar_item(rng: random.Random, *, attractor: bool | None = None) -> tuple[str, str]:
    subject, noun, number = _noun_phrase(rng)
    if attractor is None:
        attractor = rng.random() < 0.5
    prompt = subject
    if attractor:
        prompt += rng.choice(PREPOSITIONS) + _noun_phrase(rng)[0]
    return prompt, list(NOUNS.values())[noun][number] + GRAMMAR_END


# --- corpus assembly -----------------------------------------------------------------------


@dataclass
class _Facts:
    names: list[str]
    colours: dict[str, str]


def _facts_world(seed: int, n: int) -> _Facts:
    rng = _rng(seed, "facts-world")
    names: dict[str, None] = {}
    while len(names) < n:
        names.setdefault("".join(rng.choices(UPPER, k=rng.randrange(3, 6))))
    ordered = list(names)
    return _Facts(ordered, {name: rng.choice(COLOURS) for name in ordered})


def _unique_items(
    rng: random.Random, n: int, draw: Callable[[random.Random], tuple[str, str]], what: str
) -> list[tuple[str, str]]:
    items: dict[str, str] = {}
    for _ in range(1000 * n):
        prompt, target = draw(rng)
        items.setdefault(prompt, target)
        if len(items) == n:
            return list(items.items())
    raise ValueError(f"could not draw {n} distinct {what} eval prompts")


def _held_out_pairs(
    seed: int, n_eval: int, n_dev: int, level: int
) -> tuple[dict[str, list[tuple[int, int]]], dict[str, list[tuple[int, int]]], set[frozenset[int]]]:
    """Per arithmetic task n_eval ordered eval pairs and per post-training task n_dev dev pairs;
    unordered pairs disjoint across all of them (the third value: every held-out pair).

    The 2-digit (level 1) pairs are drawn at every level, so the pretraining corpus, which rejects
    them, does not depend on the level; a level above 1 draws its post tasks' pairs from its own
    space on top."""
    taken: set[frozenset[int]] = set()

    def draw(stream: str, law: Callable[[random.Random], tuple[int, int]], n: int) -> list:
        rng, pairs = _rng(seed, stream), []
        while len(pairs) < n:
            a, b = law(rng)
            if frozenset((a, b)) not in taken:
                taken.add(frozenset((a, b)))
                pairs.append((a, b))
        return pairs

    evals = {task: draw(f"{task}-eval", law, n_eval) for task, (law, _) in _ARITHMETIC.items()}
    devs = {task: draw(f"{task}-dev", _ARITHMETIC[task][0], n_dev) for task in POST_TASKS}
    if level > 1:
        for task in POST_TASKS:
            law = _level_pair_law(task, level)
            evals[task] = draw(f"{task}-eval-L{level}", law, n_eval)
            devs[task] = draw(f"{task}-dev-L{level}", law, n_dev)
    return evals, devs, taken


def _build(
    seed: int,
    sizes: CorpusSizes,
    mixture: dict[str, float],
    level: int = 1,
    holdout: str | None = None,
) -> dict[str, list]:
    """All corpora in memory: {relative path: list of records}."""
    files: dict[str, list[dict[str, str]]] = {}
    evals: dict[str, list[tuple[str, str]]] = {}
    devs: dict[str, list[tuple[str, str]]] = {}
    train: dict[str, list[tuple[str, str]]] = {}

    eval_pairs, dev_pairs, held_out = _held_out_pairs(seed, sizes.eval, sizes.dev, level)
    for task, (_, make) in _ARITHMETIC.items():
        rng = _rng(seed, f"{task}-eval-format")
        evals[task] = [make(a, b, rng) for a, b in eval_pairs[task]]
    for task in POST_TASKS:
        rng = _rng(seed, f"{task}-dev-format")
        devs[task] = [_ARITHMETIC[task][1](a, b, rng) for a, b in dev_pairs[task]]

    def arithmetic_train(task: str, n: int) -> list[tuple[str, str]]:
        make = _ARITHMETIC[task][1]
        draw_pair = _level_pair_law(task, level) if task in POST_TASKS else _ARITHMETIC[task][0]
        # The hold-out applies to post-training only: pretraining's addition covers all pairs.
        region = holdout if task in POST_TASKS else None
        rng, items = _rng(seed, f"{task}-train"), []
        while len(items) < n:
            a, b = draw_pair(rng)
            if frozenset((a, b)) not in held_out and not held_out_by(region, a, b):
                items.append(make(a, b, rng))
        return items

    world = _facts_world(seed, sizes.facts)
    string_draws = {"reverse": _reverse_item, "sort": _sort_item}
    for task, draw in string_draws.items():
        evals[task] = _unique_items(_rng(seed, f"{task}-eval"), sizes.eval, draw, task)
    evals["grammar"] = _unique_items(
        _rng(seed, "grammar-eval"),
        sizes.eval,
        lambda r: _grammar_item(r, attractor=True),
        "grammar",
    )

    def rejecting_train(task: str, n: int, draw: Callable) -> list[tuple[str, str]]:
        banned = {prompt for prompt, _ in evals[task]}
        rng, items = _rng(seed, f"{task}-train"), []
        while len(items) < n:
            item = draw(rng)
            if item[0] not in banned:
                items.append(item)
        return items

    counts = _counts(sizes.pretrain, mixture)
    empty = [d for d, n in counts.items() if n == 0]
    if empty:
        raise ValueError(f"pretraining domain(s) {empty} get no lines: raise 'pretrain' or weights")
    train["addition"] = arithmetic_train("addition", counts["addition"])
    # Round-robin over the names so every fact is seen about equally often.
    seen = world.names[: min(counts["facts"], len(world.names))]
    train["facts"] = [
        (f"{name}{FACT_SEP}", world.colours[name])
        for name in (seen[i % len(seen)] for i in range(counts["facts"]))
    ]
    for task, draw in string_draws.items():
        train[task] = rejecting_train(task, counts[task], draw)
    train["grammar"] = rejecting_train("grammar", counts["grammar"], _grammar_item)
    fact_rng = _rng(seed, "facts-eval")
    evals["facts"] = [
        (f"{name}{FACT_SEP}", world.colours[name])
        for name in fact_rng.sample(seen, min(sizes.eval, len(seen)))
    ]

    pretrain = [{"domain": d, "text": p + t} for d in PRETRAIN_DOMAINS for p, t in train[d]]
    _rng(seed, "pretrain-shuffle").shuffle(pretrain)
    files["pretrain.jsonl"] = pretrain
    for task in POST_TASKS:
        pairs = arithmetic_train(task, getattr(sizes, task))
        files[f"post/{task}.jsonl"] = [{"prompt": p, "completion": c} for p, c in pairs]
    for task in EVAL_TASKS:
        files[f"eval/{task}.jsonl"] = [{"prompt": p, "target": t} for p, t in evals[task]]
    for task in POST_TASKS:
        files[f"dev/{task}.jsonl"] = [{"prompt": p, "target": t} for p, t in devs[task]]
    return files


def _record_text(record: Mapping[str, str]) -> str:
    """The full training text of a pretraining or post-training record."""
    if "text" in record:
        return record["text"]
    return record["prompt"] + record["completion"]


def _find_overlap(
    train: Iterable[tuple[str, int, str]], prompts: Mapping[str, tuple[str, int]]
) -> None:
    """Raise if an eval prompt, as a symbol sequence, starts a training text.

    ``prompts`` maps each eval prompt to its (eval file, line). Matching at symbol boundaries
    keeps "TheCat" from matching "TheCats...": the model never saw that context.
    """
    max_len = max(map(len, prompts), default=0)
    for train_name, train_line, text in train:
        for match in _TOKEN_RE.finditer(text):
            end = match.end()
            if end > max_len:
                break
            hit = prompts.get(text[:end])
            if hit is not None:
                raise ValueError(
                    f"{hit[0]}:{hit[1]}: eval prompt {text[:end]!r} overlaps training line "
                    f"{train_name}:{train_line}"
                )


def _eval_prompts(name: str, records: Sequence[Mapping[str, str]]) -> dict[str, tuple[str, int]]:
    prompts: dict[str, tuple[str, int]] = {}
    for lineno, rec in enumerate(records, start=1):
        prompts.setdefault(rec["prompt"], (name, lineno))
    return prompts


def write_corpora(
    out_dir: Path,
    *,
    seed: int,
    sizes: Mapping[str, int] | CorpusSizes,
    mixture: Mapping[str, float] | None = None,
    level: int = 1,
    holdout: str | None = None,
) -> dict[str, Any]:
    """Write pretrain.jsonl, post/{math,math2}.jsonl, eval/{task}.jsonl, dev/{math,math2}.jsonl
    and manifest.json, the post-training tasks at difficulty `level` (POST_LEVELS), their
    training pairs outside the `holdout` region (`check_holdout`; None: no hold-out).

    Same seed, sizes, mixture, level and hold-out give byte-identical files. Returns the manifest.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    corpus_sizes, weights = _as_sizes(sizes), _as_mixture(mixture)
    if check_holdout(holdout) is not None and check_level(level) != 1:
        raise ValueError(f"a post-training hold-out needs level 1 (2-digit operands), got {level}")
    files = _build(seed, corpus_sizes, weights, check_level(level), holdout)

    # Guard against generator/alphabet drift and held-out leaks before anything is written.
    for records in files.values():
        for rec in records:
            for key, value in rec.items():
                if key != "domain":
                    split_symbols(value)
    train = [
        (name, i, _record_text(rec))
        for name in ("pretrain.jsonl", *(f"post/{t}.jsonl" for t in POST_TASKS))
        for i, rec in enumerate(files[name], start=1)
    ]
    prompts: dict[str, tuple[str, int]] = {}
    held_out_files = [f"eval/{task}.jsonl" for task in HELD_OUT_TASKS]
    for name in [*held_out_files, *(f"dev/{task}.jsonl" for task in POST_TASKS)]:
        prompts.update(_eval_prompts(name, files[name]))
    _find_overlap(train, prompts)

    out_dir = Path(out_dir)
    manifest_files: dict[str, dict[str, Any]] = {}
    for name, records in files.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (json.dumps(rec, sort_keys=True, ensure_ascii=True) + "\n" for rec in records)
        write_text(path, "".join(lines))
        manifest_files[name] = {"lines": len(records), "sha256": sha256_of(path)}
    manifest = {
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "level": level,
        "level_digits": list(POST_LEVELS[level]),
        "sizes": dataclasses.asdict(corpus_sizes),
        "mixture": weights,
        "pretrain_domain_lines": _counts(corpus_sizes.pretrain, weights),
        "eval_tasks": list(EVAL_TASKS),
        "held_out_tasks": list(HELD_OUT_TASKS),
        "memorised_tasks": list(MEMORISED_TASKS),
        "vocab_size": len(vocabulary()),
        "files": manifest_files,
    }
    if holdout is not None:  # absent otherwise, so earlier manifests stay byte-identical
        manifest["post_holdout"] = holdout
    text = json.dumps(manifest, sort_keys=True, indent=2) + "\n"
    write_text(out_dir / "manifest.json", text)
    return manifest


# --- eval-only sets ---------------------------------------------------------------------------
# Written after the corpora by their own job (`write_eval_only_set`), from a stream of their own,
# in the corpora's vocabulary: the pretraining mixture, the corpora and their manifest never
# change, so no base is retrained for them. A prompt that starts a training text is an error.


def _addition3_item(rng: random.Random) -> tuple[str, str]:
    """Addition of two 3-digit operands in the pretraining format (pretraining adds 2-digit
    operands only): does post-training carry to a longer operand?"""
    return _addition_item(rng.randrange(100, 1000), rng.randrange(100, 1000), rng)


EVAL_ONLY_ITEMS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "addition3": _addition3_item,
}
EVAL_ONLY = EVAL_SETS["eval_only"]


def write_eval_only_set(data_dir: Path, task: str) -> Path:
    """`<data_dir>/eval/<task>.jsonl` for eval-only set `task`, with the corpora's seed and eval
    size (their manifest); checked against every training text of the corpora."""
    if task not in EVAL_ONLY_ITEMS:
        raise ValueError(f"unknown eval-only set {task!r} (known: {', '.join(EVAL_ONLY_ITEMS)})")
    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    items = _unique_items(
        _rng(manifest["seed"], f"{task}-eval"),
        manifest["sizes"]["eval"],
        EVAL_ONLY_ITEMS[task],
        task,
    )
    records = [{"prompt": prompt, "target": target} for prompt, target in items]
    for record in records:
        for value in record.values():
            split_symbols(value)
    name = f"eval/{task}.jsonl"
    train = [
        (train_name, i, _record_text(record))
        for train_name in ("pretrain.jsonl", *(f"post/{t}.jsonl" for t in POST_TASKS))
        for i, record in enumerate(load_jsonl(data_dir / train_name, ()), start=1)
    ]
    _find_overlap(train, _eval_prompts(name, records))
    lines = (json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in records)
    return write_text(data_dir / name, "".join(lines))


# --- reading and checking ------------------------------------------------------------------


def check_disjoint(train_paths: Iterable[Path], eval_paths: Path | Iterable[Path]) -> int:
    """Raise ValueError naming the eval line whose prompt starts any training text.

    Training files hold ``text`` or ``prompt``+``completion`` lines; they are read once for all
    of `eval_paths` (one eval file or several). Returns the number of eval items checked.
    """
    eval_paths = [eval_paths] if isinstance(eval_paths, (str, Path)) else list(eval_paths)
    prompts: dict[str, tuple[str, int]] = {}
    n_items = 0
    for eval_path in eval_paths:
        eval_records = load_jsonl(Path(eval_path), ("prompt", "target"))
        for prompt, where in _eval_prompts(str(eval_path), eval_records).items():
            prompts.setdefault(prompt, where)
        n_items += len(eval_records)

    def train_texts() -> Iterable[tuple[str, int, str]]:
        for train_path in train_paths:
            for i, rec in enumerate(_load_train(Path(train_path)), start=1):
                yield str(train_path), i, _record_text(rec)

    _find_overlap(train_texts(), prompts)
    return n_items


def _load_train(path: Path) -> list[dict[str, Any]]:
    """Load a pretraining (text) or post-training (prompt, completion) file, told by line 1."""
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = None  # load_jsonl below reports it with file and line
    keys = ("text",) if isinstance(head, dict) and "text" in head else ("prompt", "completion")
    return load_jsonl(path, keys)
