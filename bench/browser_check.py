"""Browser check: what a researcher sees in MLflow's UI and in Snakemake's report, rendered by a
real (headless) Chromium, on a smoke results folder.

    snakemake --cores 1 --configfile config/smoke.yaml --config results_dir=/tmp/rpb_smoke \\
        -- /tmp/rpb_smoke/table1.csv
    python bench/browser_check.py --results /tmp/rpb_smoke      # screenshots to a temporary folder
    python bench/browser_check.py --results /tmp/rpb_smoke --screenshots docs/img   # the docs'

It builds `<results>/report.html` (`snakemake --report`, table 1's target), starts `mlflow server`
on 127.0.0.1 against `<results>/mlflow.db`, and drives a fresh Chromium profile (Debian's
`chromium`, installed with apt-get if missing and possible, else the check is skipped with a
message) through the DevTools protocol over aiohttp's websocket (a dependency of mlflow), with real
mouse clicks. From the rendered DOM it asserts that

1. the experiment opens in the model-training view and its description names the project;
2. each invocation is one row whose expander shows the job runs nested under it;
3. the Group-by menu lists the schema's tags `method`, `base`, `seed`, `model`, `corpus` before
   every param, within its first 12 entries (their positions are printed); grouping the chart
   view by `method` takes at most three clicks (docs/results.md's) and gives one group per method
   of the store (table 1's and hard, check M2's), MLflow draws the groups in distinct colours,
   one per method, the colours of its hash of `tag.method.<label>` (printed), which each
   method's runs carry too (`mlflow.runColor`),
   and the compare page of table 1's eval and analysis runs lists its params and metrics;
4. table 1's view (the link `make ui` prints, rpb.pipeline.tracking.table1_view_state) shows one
   group per method of table 1 (no `hard`) on p(target), the verdicts' measure: its chart titles
   whole, on the first screen, each legend naming every method, the bars table 1's
   `in_domain_p` and `ood_mean_p`;
5. report.html opens on table 1 (its headline, one row per method, whole on the first screen,
   with the verdicts of C1 and C2 and the checks as a list, none reading FAILED), links table 1
   itself there (one click: the columns a reader needs, all in view at 1400 px), lists table 1
   and its figure, and shows both when opened.

MLflow is looked at as a first visit sees it: a fresh profile, at 1400 x 900, with the Assistant
panel as MLflow opens it (a third of the window; the check never closes it). Run by
tests/test_browser_check.py on the suite's smoke run where `chromium` is installed.

Screenshots go to a new temporary folder (its path is printed), or to `--screenshots DIR` when
given (`docs/img` refreshes the documentation's). The server is stopped with SIGINT (SIGTERM
orphans its workers). Exit status: 0 passed or skipped, 1 a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WINDOW = (1400, 900)  # issue 48: chart titles legible at 1400 px


class CheckFailed(AssertionError):
    """One of the browser checks did not hold."""


def check(condition: Any, what: str) -> None:
    if not condition:
        raise CheckFailed(what)
    print(f"ok   {what}")


# --- the browser ----------------------------------------------------------------------------------


def find_chromium() -> str | None:
    """Debian's chromium, installed with apt-get when missing (as root); None if it cannot be."""
    found = shutil.which("chromium")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    print("chromium is missing: apt-get install chromium", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if cmd[1] == "install" and done.returncode == 0:
            break
    return shutil.which("chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


class Page:
    """One browser tab, driven through the DevTools protocol."""

    def __init__(self, ws: Any):
        self.ws, self.calls, self.clicks = ws, 0, 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.calls += 1
        await self.ws.send_json({"id": self.calls, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def js(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def text(self) -> str:
        return await self.js("document.body ? document.body.innerText : ''") or ""

    async def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """The value of `expression` once truthy (polled), or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                value = await self.js(expression)
                if value:
                    return value
            await asyncio.sleep(0.5)
        return None

    async def wait_text(self, text: str, timeout: float = 60) -> bool:
        script = f"document.body && document.body.innerText.includes({json.dumps(text)})"
        return bool(await self.wait_for(script, timeout))

    async def click(self, element: str) -> None:
        """A real mouse click (press and release) at the centre of the element `element` (a JS
        expression) evaluates to; menus that open on pointer-down need one."""
        box = await self.js(
            f"(() => {{ const e = ({element}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        if not box:
            raise CheckFailed(f"nothing to click: {element}")
        x, y = box
        self.clicks += 1
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            extra = {"button": "left", "clickCount": 1} if kind != "mouseMoved" else {}
            await self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)
        await asyncio.sleep(1.0)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        print(f"     screenshot {path}")


@contextlib.contextmanager
def chromium(binary: str) -> Iterator[str]:
    """A headless Chromium with a fresh profile; yields its first tab's DevTools websocket URL."""
    profile = Path(tempfile.mkdtemp(prefix="rpb-chromium-"))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--remote-debugging-port={port}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError, ValueError):
                pages = [
                    t
                    for t in _get_json(f"http://127.0.0.1:{port}/json/list")
                    if t["type"] == "page"
                ]
                if pages:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed("chromium did not start")
            time.sleep(0.2)
        yield pages[0]["webSocketDebuggerUrl"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


# --- the MLflow server ---------------------------------------------------------------------------


def _live_members(group: int) -> list[int]:
    """Processes of process group `group` that are not zombies."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                live.append(int(stat.parent.name))
    return live


@contextlib.contextmanager
def mlflow_server(store: str, port: int) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1:`port` against `store`, without its GenAI job runners (seven
    more processes); stopped with SIGINT, which it forwards to its workers."""
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow) if mlflow.exists() else "mlflow", "server", "--backend-store-uri", store]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise CheckFailed(f"mlflow server did not start: {log.read()[-2000:]!r}")
                time.sleep(0.5)
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise CheckFailed("mlflow server ignored SIGINT for 60 s") from None
            left = _live_members(proc.pid)
            if left:
                os.killpg(proc.pid, signal.SIGKILL)
                raise CheckFailed(f"mlflow server's workers {left} outlived it after SIGINT")
            print("ok   mlflow server stopped by SIGINT, no worker left")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# --- what the checks read -------------------------------------------------------------------------


def store_facts(results: Path) -> dict[str, Any]:
    """Experiment id, invocation runs, and table 1's eval/analysis run ids, from the store."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from rpb.specs import Run, spec_runs

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rpb")
    if experiment is None:
        raise CheckFailed(f"{results / 'mlflow.db'} has no experiment 'rpb'")
    runs = client.search_runs([experiment.experiment_id], max_results=5000)
    table = pd.read_csv(results / "table1.csv")
    latest: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        if run.info.status == "FINISHED":
            latest[run.info.run_name] = run
    meta = json.loads((results / "table1.meta.json").read_text())
    # Each base is evaluated as method `base` under its seed 0.
    seeds = spec_runs(meta)
    base_runs = sorted({Run(run.base, 0) for run in seeds})
    table1_runs = []
    for method in table["method"]:
        for run in base_runs if method == "base" else seeds:
            for stage in ("eval", "analysis"):
                name = f"{stage}/{meta['model']}/{meta['corpus']}/{method}/{run.name}"
                table1_runs.append(latest[name])
    return {
        "experiment_id": experiment.experiment_id,
        "invocations": [r for r in runs if r.data.tags.get("stage") == "invocation"],
        "jobs": [r for r in runs if r.data.tags.get("stage") != "invocation"],
        "table": table,
        "table1_runs": table1_runs,
        "meta": meta,
    }


def build_report(results: Path, configfile: str) -> Path:
    """`snakemake --report` for table 1's target of `results` (reads the outputs, runs nothing)."""
    report = results / "report.html"
    cmd = [sys.executable, "-m", "snakemake", "--report", str(report)]
    cmd += ["--configfile", configfile, "--config", f"results_dir={results}"]
    cmd += ["--", str(results / "table1.csv")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not report.is_file():
        raise CheckFailed(f"snakemake --report failed:\n{done.stderr[-3000:]}")
    return report


# --- the checks -----------------------------------------------------------------------------------

BUTTONS = "[...document.querySelectorAll('button')]"
RUN_NAMES = "[...document.querySelectorAll('a[href*=\"/runs/\"]')].map(a => a.innerText.trim())"
EXPANDERS = "document.querySelectorAll('button[data-component-id*=\"runnamecellrenderer\"]')"


ASSISTANT = (
    "document.querySelector('button[data-component-id=\"mlflow.assistant.chat_panel.close\"]')"
)


async def assistant_open(page: Page) -> bool:
    """Whether MLflow's Assistant side panel shows. A fresh profile opens with it (a third of the
    window at 1400 px); the checks look at the page as it opens and never close it."""
    return bool(await page.wait_for(f"!!{ASSISTANT}", 10))


GROUP_DOTS = (
    "[...document.querySelectorAll('*')].filter(e => e.children.length === 0"
    " && /^Group: /.test(e.textContent.trim())).map(e => { let row = e;"
    " for (let i = 0; i < 6 && row; i++) { const dot = [...row.querySelectorAll('*')].find(x => {"
    " const r = x.getBoundingClientRect(), c = getComputedStyle(x).backgroundColor;"
    " return r.width > 4 && r.width <= 16 && r.height <= 16 && c !== 'rgba(0, 0, 0, 0)'"
    " && c !== 'rgb(255, 255, 255)'; });"
    " if (dot) return [e.textContent.trim().slice(7), getComputedStyle(dot).backgroundColor];"
    " row = row.parentElement; } return [e.textContent.trim().slice(7), null]; })"
)


def _hex(rgb: str) -> str:
    parts = [int(v) for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3]]
    return "#" + "".join(f"{v:02x}" for v in parts)


async def check_colours(page: Page, facts: dict[str, Any], methods: list[str]) -> None:
    """One colour per method. Grouped by `method`, MLflow 3.17 draws each group in a colour of its
    own: it colours a group by a hash of its key, `tag.method.<label>`
    (rpb.pipeline.tracking.group_color reproduces it), and reads no run's tag for it; each
    method's runs carry that colour too (tag `mlflow.runColor`, which MLflow draws for a run)."""
    from rpb.pipeline.tracking import group_color

    by_method: dict[str, set[str]] = {}
    for run in facts["table1_runs"]:
        color = run.data.tags.get("mlflow.runColor")
        by_method.setdefault(run.data.tags.get("method", "?"), set()).add(str(color).lower())
    one_each = all(len(c) == 1 for c in by_method.values())
    distinct = {m: next(iter(c)) for m, c in by_method.items()}
    check(
        one_each and len(set(distinct.values())) == len(methods) == len(distinct),
        f"one colour per method's runs, all distinct (mlflow.runColor): {distinct}",
    )
    # Every method of the store gets a group: table 1's rows and the runs its checks read (hard,
    # check M2's upper end).
    stored = sorted({r.data.tags["method"] for r in facts["jobs"] if "method" in r.data.tags})
    n = len(stored)
    groups = dict(
        await page.wait_for(
            f"(() => {{ const g = {GROUP_DOTS}; return g.length >= {n} && g; }})()", 20
        )
        or []
    )
    drawn = {m: _hex(c) if c else None for m, c in groups.items()}
    print(f"     MLflow draws the groups in {drawn}")
    check(
        set(methods) <= set(drawn) == set(stored)
        and None not in drawn.values()
        and len(set(drawn.values())) == n,
        f"{n} groups in {n} distinct colours, one per method of the store ({', '.join(stored)})",
    )
    expected = {m: group_color(f"tag.method.{m}") for m in stored}
    check(
        drawn == expected,
        "the groups' colours are MLflow's hash of `tag.method.<label>` (tracking.group_color)",
    )
    check(
        all(distinct[m] == drawn[m] for m in distinct),
        "each method's runs carry their group's colour (tracking.run_color)",
    )


# Where the schema's tags (rpb.pipeline.tracking.SCHEMA_TAGS) must be: all before every param,
# within the menu's first 12 entries (of ~70). The menu gathers the tags over the runs, latest
# first, each run's in the order it logged them: with table 1's run latest, its `model` and
# `corpus` (entries 2 and 3, after Attributes' Dataset), its six bookkeeping tags (the commit is
# MLflow's own `mlflow.source.git.commit`, which the menu hides), then the eval runs' `method`,
# `base`, `seed` (10 to 12). The menu's list shows ten entries before it scrolls, so `method` is
# on its first screen. As params they were entries 16 to 53, below every tag.
SCHEMA_TAGS_WITHIN = 12
# Each Group-by entry (`ITEMS`: the menu's items): its text, and whether it shows before the
# menu's list (its nearest scrolling ancestor) is scrolled.
MENU_ENTRIES = (
    "ITEMS.map(e => { let p = e.parentElement; while (p && !(p.scrollHeight > p.clientHeight + 1"
    " && /(auto|scroll)/.test(getComputedStyle(p).overflowY))) p = p.parentElement;"
    " const r = e.getBoundingClientRect(), c = p ? p.getBoundingClientRect()"
    " : {top: 0, bottom: innerHeight};"
    " return [e.innerText.trim(), r.top >= c.top - 1 && r.bottom <= c.bottom + 1]; })"
)


async def check_group_by_menu(page: Page, facts: dict[str, Any], items: str) -> None:
    """The schema's tags open the Group-by menu: as tags, before every param, within its first
    `SCHEMA_TAGS_WITHIN` entries (read as it opens, before any scrolling)."""
    from rpb.pipeline.tracking import SCHEMA_TAGS

    entries = await page.js(MENU_ENTRIES.replace("ITEMS", items))
    listed = [name for name, _ in entries]
    params = {k for run in facts["jobs"] for k in run.data.params}
    at = {n: listed.index(n) + 1 for n in SCHEMA_TAGS if n in listed}
    first_param = min((i + 1 for i, n in enumerate(listed) if n in params), default=len(listed))
    screen = sum(1 for _, visible in entries if visible)
    print(
        f"     Group by lists {len(listed)} entries, {screen} before its list scrolls; "
        f"{', '.join(SCHEMA_TAGS)} at {[at.get(n) for n in SCHEMA_TAGS]}; the first param at "
        f"{first_param}"
    )
    check(
        set(at) == set(SCHEMA_TAGS) and not set(SCHEMA_TAGS) & params,
        f"Group by lists {', '.join(SCHEMA_TAGS)} as tags, none as a param",
    )
    check(
        max(at.values()) < first_param and max(at.values()) <= SCHEMA_TAGS_WITHIN,
        f"they are among the first {SCHEMA_TAGS_WITHIN} entries of Group by, before every param",
    )


CHART_TITLES = "[...document.querySelectorAll('h4')]"


async def check_table1_view(page: Page, url: str, facts: dict[str, Any], out: Path) -> None:
    """Table 1's view (`make ui` prints its link; rpb.pipeline.tracking.table1_view_state), read
    with the Assistant panel as MLflow opens it: one group per method of table 1 (no `hard`), the
    p(target) charts first on screen, each title whole and each legend naming every method, and
    the bars table 1's p(target) columns."""
    from rpb.pipeline.tracking import P_TARGET_COLUMNS, table1_metric, table1_view_link

    await page.goto(table1_view_link(facts["experiment_id"], url))
    methods = [str(m) for m in facts["table"]["method"]]
    groups = json.dumps([f"Group: {m}" for m in methods])
    names = [table1_metric(c) for c in P_TARGET_COLUMNS]
    shown = f"{CHART_TITLES}.filter(e => {json.dumps(names)}.includes(e.textContent.trim()))"
    await page.wait_for(f"{shown}.length === {len(names)}", 60)
    await asyncio.sleep(3)
    panel = await assistant_open(page)
    print(f"     table 1's view, the Assistant panel open: {panel}")
    await page.screenshot(out / "mlflow_table1_view.png")
    titles = await page.js(
        f"{shown}.map(e => [e.textContent.trim(), e.scrollWidth <= e.clientWidth + 1,"
        " e.getBoundingClientRect().top > 0 && e.getBoundingClientRect().bottom < innerHeight])"
    )
    check(
        titles and [t[0] for t in titles] == names and all(t[1] and t[2] for t in titles),
        f"table 1's view opens on the p(target) charts {names}, on screen, titles whole ({titles})",
    )
    # A legend's entries: the card's leaf elements outside the plot (svg) that name a method of the
    # store, inside the card's box (a cut legend scrolls the rest out of it).
    stored = sorted({str(r.data.tags.get("method")) for r in facts["jobs"]} | set(methods))
    legends = await page.js(
        f"{shown}.map(h => {{ let c = h; while (c.parentElement && c.parentElement"
        ".querySelectorAll('h4').length === 1) c = c.parentElement;"
        " const box = c.getBoundingClientRect();"
        " return [...c.querySelectorAll('*')].filter(e => e.children.length === 0"
        f" && !e.closest('svg') && {json.dumps(stored)}.includes(e.textContent.trim()))"
        ".filter(e => { const r = e.getBoundingClientRect(); return r.width > 0"
        " && r.top >= box.top && r.bottom <= box.bottom && r.left >= box.left"
        " && r.right <= box.right; }).map(e => e.textContent.trim()); })"
    )
    print(f"     the charts' legends: {legends}")
    check(
        legends and all(sorted(legend) == sorted(methods) for legend in legends),
        f"each legend names table 1's methods {methods}, no other, all in view",
    )
    listed = await page.js(f"{groups}.filter(g => document.body.innerText.includes(g))")
    others = await page.js("document.body.innerText.includes('Group: hard')")
    check(len(listed) == len(methods) and not others, f"one group per method of table 1 {listed}")
    # The bars: each group's mean over its runs, table 1's p(target) columns to 2 decimals.
    wanted = sorted(f"{v:.2f}" for c in P_TARGET_COLUMNS for v in facts["table"][c])
    bars = "[...document.querySelectorAll('text.bartext')].map(e => e.textContent.trim()).sort()"
    read = sorted(await page.js(bars) or [])
    check(read == wanted, f"the bars are table 1's {', '.join(P_TARGET_COLUMNS)} ({read})")


async def check_mlflow(page: Page, url: str, facts: dict[str, Any], out: Path) -> None:
    experiment = facts["experiment_id"]
    # What a first visit shows: the home page `make ui` prints, then the experiment's link there.
    await page.goto(f"{url}/#/")
    link = (
        f"[...document.querySelectorAll('a[href*=\"experiments/{experiment}\"]')]"
        ".find(a => a.innerText.trim() === 'rpb')"
    )
    check(await page.wait_for(f"!!{link}", 60), "the home page links the experiment rpb")
    print(f"     MLflow's Assistant panel open as the page opens: {await assistant_open(page)}")
    await page.screenshot(out / "mlflow_home.png")
    await page.click(link)
    await page.wait_text("Router Prior Bias", 30)
    await asyncio.sleep(3)
    landed = await page.js("location.hash")
    print(f"     the experiment's link on the home page lands on {landed}")
    await page.screenshot(out / "mlflow_experiment_from_home.png")
    # MLflow 3.17 ignores the experiment's kind tag (its UI follows a switch kept in the browser,
    # GenAI until changed): a fresh profile lands in the GenAI overview. One click on the home
    # page's *Model training* switch, kept from then on, and the link opens the runs table.
    print(f"     a fresh profile (GenAI switch): {'genai' in landed and 'overview' in landed}")
    await page.goto(f"{url}/#/")
    check(await page.wait_for(f"!!{link}", 60), "the home page links the experiment rpb again")
    await page.click(
        "[...document.querySelectorAll('*')]"
        ".find(e => e.children.length === 0 && e.textContent.trim() === 'Model training')"
    )
    await page.click(link)
    await page.wait_text("Router Prior Bias", 30)
    await asyncio.sleep(3)
    again = await page.js("location.hash")
    print(f"     after the Model training switch, the home page's link lands on {again}")
    await page.screenshot(out / "mlflow_experiment_from_home_model_training.png")
    check("/runs" in again, "after the Model training switch the home page's link opens the runs")
    await page.goto(f"{url}/#/experiments/{experiment}/runs?workflowType=machine_learning")
    listed = await page.wait_for(f"{RUN_NAMES}.some(n => n.startsWith('invocation/'))")
    check(listed, "the model-training runs table lists invocations")
    check(
        "Router Prior Bias" in await page.text(), "the experiment's description names the project"
    )
    names = await page.js(RUN_NAMES)
    top = [n for n in names if n.startswith("invocation/")]
    check(len(top) == len(facts["invocations"]), f"one row per invocation ({len(top)})")
    job = next(r.info.run_name for r in facts["jobs"] if r.data.tags.get("stage") == "eval")
    shown = job in names
    for i in range(len(top)):  # collapsed: expand the invocations, latest first, as a user would
        if shown:
            break
        await page.click(f"{EXPANDERS}[{i}]")
        shown = await page.wait_for(f"{RUN_NAMES}.includes({json.dumps(job)})", 10)
    check(shown, "expanding an invocation shows its job runs")
    nested = await page.js(RUN_NAMES)
    check(len(nested) > len(top), f"job runs nested under their invocation ({len(nested)} rows)")
    await page.screenshot(out / "mlflow_runs_nested.png")

    # Table 1 in three clicks: chart view, Group by, method (a param of eval and analysis runs).
    clicks = page.clicks
    await page.click("document.querySelector('input[value=CHART]').closest('label')")
    await page.click(f"{BUTTONS}.find(b => b.innerText.trim().startsWith('Group by'))")
    # The menu lists Attributes, Tags, then Params; `method` is a tag only (no param of the name).
    items = "[...document.querySelectorAll('[role=menuitemcheckbox]')]"
    named = f"{items}.filter(e => e.innerText.trim() === 'method')"
    check(await page.wait_for(f"{named}.length", 10) == 1, "Group by lists `method` once")
    await check_group_by_menu(page, facts, items)
    await page.click(f"{named}[0]")
    await page.js("document.activeElement && document.activeElement.blur()")
    await page.call("Input.dispatchKeyEvent", type="keyDown", key="Escape", code="Escape")
    methods = list(facts["table"]["method"])
    groups = json.dumps([f"Group: {m}" for m in methods])
    grouped = await page.wait_for(f"{groups}.every(g => document.body.innerText.includes(g))", 20)
    check(grouped, f"grouped by method: one group per method of table 1 {methods}")
    used = page.clicks - clicks
    check(used <= 3, f"grouping by method took {used} clicks (at most three)")
    await check_colours(page, facts, methods)
    await asyncio.sleep(2)
    await page.screenshot(out / "mlflow_grouped_first_screen.png")
    search = "document.querySelector('input[placeholder=\"Search metric charts\"]')"
    check(await page.wait_for(f"!!{search}", 10), "the chart view has its metric search")
    for metric in ("accuracy/in_domain", "coact/cosine"):
        await page.click(search)
        await page.js(f"{search}.select()")
        await page.call("Input.insertText", text=metric)
        title = "[...document.querySelectorAll('*')].some(e => e.children.length === 0"
        shown = await page.wait_for(f"{title} && e.textContent.trim() === {json.dumps(metric)})")
        check(shown, f"the chart of {metric} by method shows")
    # The bars' labels are the groups' means over their runs: table 1's column, to 2 decimals,
    # among one bar per method of the store (hard's runs, check M2's, have a group too).
    wanted = sorted(f"{v:.2f}" for v in facts["table"]["coact_cosine"])
    n = len({r.data.tags["method"] for r in facts["jobs"] if "method" in r.data.tags})
    bars = "[...document.querySelectorAll('text.bartext')].map(e => e.textContent.trim()).sort()"
    await page.wait_for(f"{bars}.length >= {n}", 20)
    read = sorted(await page.js(bars) or [])
    same = len(read) == n and not Counter(wanted) - Counter(read)  # table 1's are among them
    check(same, f"the bars give table 1's coact_cosine per method {wanted} (bars: {read})")
    await page.screenshot(out / "mlflow_table1_by_method.png")
    await check_table1_view(page, url, facts, out)

    # The compare page of table 1's runs: table 1's params and metrics side by side.
    ids = json.dumps([r.info.run_id for r in facts["table1_runs"]]).replace(" ", "")
    await page.goto(
        f"{url}/#/compare-runs?runs={ids}&experiments=[%22{experiment}%22]"
        "&workflowType=machine_learning"
    )
    check(await page.wait_text("accuracy/in_domain"), "the compare page of table 1's runs opens")
    text = await page.text()
    wanted = ["kind", "strength", "options", "seed", "accuracy/in_domain", "accuracy/ood_mean"]
    wanted += [f"coact/{c}" for c in ("nmi", "cosine", "modularity")]
    missing = [name for name in wanted if name not in text]
    check(not missing, f"the compare page lists table 1's params and metrics (missing: {missing})")
    # MLflow 3.17 renders the first rows of a long metric list only (the ood/<task> rows may come
    # after them); the chart view above is where table 1's columns are read.
    tasks = [c[4:] for c in facts["table"].columns if c.startswith("ood_") and c[-2:] != "_p"]
    ood = [f"ood/{t}" for t in tasks if f"ood/{t}" in text and t != "mean"]
    print(f"     the compare page renders the OOD columns {ood}")
    await page.screenshot(out / "mlflow_compare_table1_runs.png")


async def check_landing(page: Page, results: Path, out: Path) -> None:
    """report.html's first screen, before any click: table 1's headline and its verdicts."""
    import pandas as pd

    landing = "document.querySelector('.rpb-landing')"
    check(await page.wait_for(f"!!{landing}", 30), "report.html opens on table 1's landing page")
    await asyncio.sleep(1)
    text = await page.js(f"{landing}.innerText")
    check(text.startswith("Table 1"), f"the landing page's title is table 1's: {text[:60]!r}")
    methods = pd.read_csv(results / "table1.csv")["method"].astype(str).tolist()
    rows = await page.js(
        f"[...{landing}.querySelectorAll('table.headline tbody tr')]"
        ".map(r => r.cells[0].innerText.trim())"
    )
    check(rows == methods, f"its headline table has one row per method of table1.csv {rows}")
    lead = await page.js(f"{landing}.querySelector('p.lead').innerText")
    check("C1 (" in lead and "C2 (" in lead, f"its lead states the verdicts of C1 and C2: {lead}")
    box = await page.js(
        f"(() => {{ const r = {landing}.querySelector('table.headline').getBoundingClientRect();"
        " return [r.left, r.top, r.right, r.bottom, innerWidth, innerHeight]; })()"
    )
    left, top, right, bottom, width, height = box
    check(
        left >= 0 and right <= width and top >= 0 and bottom <= height,
        f"the headline table is on the first screen, whole ({box})",
    )
    checks = await page.js(f"[...{landing}.querySelectorAll('ul.checks li')].map(l => l.innerText)")
    check(checks, f"the checks are a list ({len(checks)})")
    check("FAILED" not in text, "no check reads as a failure (met / not met / undetermined)")
    for line in checks:
        print(f"     {line}")
    await page.screenshot(out / "report_landing.png")
    await check_table_view(page, results, out)


async def check_table_view(page: Page, results: Path, out: Path) -> None:
    """Table 1 one click from the first screen (the landing's link), every column in view at the
    window's width, the columns a reader needs (rpb.report.table1.READER_COLUMNS)."""
    import pandas as pd

    from rpb.report.table1 import READER_COLUMNS

    link = "document.querySelector('.rpb-landing a.rpb-open-table')"
    box = await page.js(
        f"(() => {{ const r = {link} && {link}.getBoundingClientRect();"
        " return r && [r.top, r.bottom, innerHeight]; })()"
    )
    check(box and box[0] >= 0 and box[1] <= box[2], f"the first screen links table 1 ({box})")
    clicks = page.clicks
    await page.click(link)
    frame = "[...document.querySelectorAll('iframe')].find(f => f.src.startsWith('data:text/html'))"
    check(await page.wait_for(f"!!{frame}", 10), "the link shows table 1 in the report's pane")
    check(page.clicks - clicks == 1, "table 1 is one click from the report's first screen")
    await asyncio.sleep(1)
    # The frame (a data: URI) is another origin: its document is read in a world of its own.
    tree = await page.call("Page.getFrameTree")
    child = next(
        c["frame"]["id"]
        for c in tree["frameTree"].get("childFrames", [])
        if c["frame"].get("url", "").startswith("data:text/html")
    )
    world = await page.call("Page.createIsolatedWorld", frameId=child)
    inside = await page.call(
        "Runtime.evaluate",
        expression="(() => { const t = document.querySelector('table'); return t && "
        "[[...t.querySelectorAll('th')].map(h => h.innerText.trim()),"
        " t.getBoundingClientRect().right, document.documentElement.clientWidth]; })()",
        contextId=world["executionContextId"],
        returnByValue=True,
    )
    fit = [*(inside["result"].get("value") or [[], 0, 0]), await page.js("innerWidth")]
    heads, right, width, window = fit
    columns = [c for c in READER_COLUMNS if c in pd.read_csv(results / "table1.csv").columns]
    print(f"     the table's columns {heads}, its right edge {right} in a {width} px pane")
    check(heads == columns, f"it shows the columns a reader needs {columns}")
    check(0 < right <= width, f"all {len(heads)} columns in view at {window} px")
    await page.screenshot(out / "report_table1_view.png")


async def check_report(page: Page, report: Path, results: Path, out: Path) -> None:
    await page.goto(report.resolve().as_uri())
    await check_landing(page, results, out)
    await page.goto(report.resolve().as_uri())  # back to the first screen
    link = "[...document.querySelectorAll('a')].find(a => a.innerText.trim() === {!r})"
    check(await page.wait_for("!!" + link.format("Results")), "report.html opens")
    category = None
    # The report's menu moves while it renders, so a click at a position can hit its neighbour:
    # its links are clicked as elements.
    for _ in range(5):
        await page.js(f"{link.format('Results')}.click()")
        category = await page.wait_for("!!" + link.format("Table 1"), 4)
        if category:
            break
    check(category, "report.html has the category Table 1")
    await page.js(f"{link.format('Table 1')}.click()")
    wanted = ["Co-activation per run", "Data", "Table"]
    listed = " && ".join(f"!!{link.format(name)}" for name in wanted)
    check(await page.wait_for(listed, 10), f"Table 1 has the subcategories {wanted}")
    # The table, rendered: its HTML (with the verdicts in the caption) opens in a frame.
    await page.js(f"{link.format('Table')}.click()")
    rows = "[...document.querySelectorAll('tr')]"
    row = f"{rows}.find(r => r.cells[0].innerText.trim().startsWith('table1.html'))"
    check(await page.wait_for(f"!!{row}", 10), "Table 1's Table lists table1.html")
    await page.js(f"{row}.querySelector('a[iconname=eye]').click()")
    frame = "[...document.querySelectorAll('iframe')].find(f => f.src.includes('table1.html'))"
    src = await page.wait_for(f"{frame} && {frame}.src", 10)
    check(src, "opening table1.html shows it in a frame")
    embedded = base64.b64decode(src.split("base64,", 1)[1])
    check(embedded == (results / "table1.html").read_bytes(), "the frame is table1.html")
    html = embedded.decode()
    import pandas as pd

    methods = pd.read_csv(results / "table1.csv")["method"].astype(str)
    check("<table" in html and all(m in html for m in methods), "table1.html is a table")
    check("C1" in html and "C2" in html, "table1.html states the verdicts of C1 and C2")
    size = await page.js(
        f"(() => {{ const r = {frame}.getBoundingClientRect(); return [r.width, r.height]; }})()"
    )
    check(size and size[0] > 400 and size[1] > 300, f"the frame is on screen ({size})")
    await page.screenshot(out / "report_table1.png")
    # Every run's co-activation heatmap.
    await page.js(f"{link.format('Table 1')}.click()")
    await page.wait_for(f"!!{link.format('Co-activation per run')}", 10)
    await page.js(f"{link.format('Co-activation per run')}.click()")
    runs = sorted((results / "figures" / "table1_coactivation_runs").glob("*.png"))
    count = f"{rows}.filter(r => r.querySelector('a[iconname=eye]')).length"
    listed = await page.wait_for(f"{count} >= {len(runs)} && {count}", 10)
    check(runs and listed == len(runs), f"Co-activation per run lists {len(runs)} heatmaps")
    await page.click(
        f"{rows}.find(r => r.querySelector('a[iconname=eye]')).querySelector('a[iconname=eye]')"
    )
    shown = await page.wait_for(
        "[...document.querySelectorAll('img')].some(i => i.naturalWidth > 100"
        " && i.getBoundingClientRect().width > 100)",
        20,
    )
    check(shown, "opening a run's co-activation heatmap in report.html shows the image")
    await page.screenshot(out / "report_figure.png")


async def run_checks(args: argparse.Namespace, binary: str) -> None:
    import aiohttp

    results = args.results.resolve()
    facts = store_facts(results)
    report = None if args.no_report else build_report(results, args.configfile)
    store = f"sqlite:///{results / 'mlflow.db'}"
    with mlflow_server(store, free_port()) as url, chromium(binary) as ws_url:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(ws_url, max_msg_size=0) as ws,
        ):
            page = Page(ws)
            await page.call("Page.enable")
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=WINDOW[0],
                height=WINDOW[1],
                deviceScaleFactor=1,
                mobile=False,
            )
            # The report first: Chromium does not navigate from an http page to a file: URL.
            if report is not None:
                await check_report(page, report, results, args.out)
            await check_mlflow(page, url, facts, args.out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True, help="a smoke results folder")
    parser.add_argument("--configfile", default="config/smoke.yaml", help="its config file")
    parser.add_argument(
        "--screenshots",
        "--out",
        dest="out",
        type=Path,
        metavar="DIR",
        help="where screenshots go (default: a new temporary folder; docs/img: the docs' own)",
    )
    parser.add_argument(
        "--no-report",
        action="store_true",
        help="MLflow only (a folder re-logged by bench/relog_smoke.py has no outputs to report)",
    )
    args = parser.parse_args(argv)
    if not (args.results / "mlflow.db").is_file() or not (args.results / "table1.csv").is_file():
        parser.error(f"{args.results} has no mlflow.db and table1.csv: run the smoke table 1")
    binary = find_chromium()
    if binary is not None:
        if args.out is None:
            args.out = Path(tempfile.mkdtemp(prefix="rpb_browser_check_"))
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"screenshots: {args.out}")
    if binary is None:
        print("SKIPPED: no chromium (apt package `chromium`) and it cannot be installed here")
        return 0
    try:
        asyncio.run(run_checks(args, binary))
    except CheckFailed as failed:
        print(f"FAIL {failed}")
        return 1
    print("browser check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
