"""``jobs/stream.py --dry-run``: every preset under jobs/configs/ passes with model.path pointed at a tiny
folder carrying Qwen3's official chat template, its data sources faked (expert files in the AgentGym / ETO
formats, an official-layout ALFWorld folder, the loopback WebShop env server); a missing or malformed
source fails the run before any work, naming the setting and the path or URL.

Needs a JVM (ScienceWorld), the alfworld package (one generated game, copied into the official layout).
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from expert_formats import agentgym_item, eto_item, write

from hamo_ray.config import EnvConfig, load_config
from hamo_ray.envs import get_domain
from hamo_ray.envs.webshop.catalog import build_catalog
from hamo_ray.envs.webshop.server import StandinServer
from hamo_ray.run.dryrun import dry_run

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "jobs" / "configs").glob("*.yaml"))
GAME = "pick_and_place_simple-Cd-None-Box-1/trial_T1"


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    """The paper presets bind 0.0.0.0 and take their key from the environment (refused without one)."""
    monkeypatch.setenv("HAMO_API_KEY", "preset-test-key")


def _cli():
    spec = importlib.util.spec_from_file_location("stream_job", ROOT / "jobs" / "stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Faked data sources: {"alfworld": official root, "experts": {domain: file}, "url": env server}."""
    root = tmp_path_factory.mktemp("sources")
    gen = EnvConfig(domain="alfworld", alfworld={"games": "generated", "games_dir": str(root / "gen")})
    game = get_domain("alfworld", gen).store.game_file("train", "pick_and_place_simple", 0)
    for split_dir in ("train", "valid_seen", "valid_unseen"):
        shutil.copytree(game.parent, root / "alfworld" / "json_2.1.1" / split_dir / GAME)
    room = "You are in the middle of a room. Looking quickly around you, you see a box 1, a shelf 1."
    steps = (
        ["go to shelf 1", "take cd 1 from shelf 1", "go to box 1", "put cd 1 in/on box 1"],
        ["o1", "o2", "o3", "o4"],
    )
    page = "WebShop [SEP] Instruction: [SEP] i need a red lip balm [SEP] Search"
    experts = {
        "scienceworld": write(
            root / "sciworld_sft.json",
            [eto_item("0_3", "Your task is to boil water.", ["look around", "teleport to kitchen"], ["This room is called the hallway.", "You teleport."])],
        ),
        "alfworld": write(
            root / "alfworld_sft.json",
            [eto_item(0, f"{room}\n\nYour task is to: put a cd in box.", *steps, game_file=f"json_2.1.1/train/{GAME}")],
        ),
        "webshop": write(
            root / "webshop_sft.json",
            [agentgym_item("webshop_1500", page, ["search[red lip balm]", "click[buy now]"], ["results", "bought"])],
        ),
    }  # fmt: skip
    server = StandinServer(build_catalog(0, 500))
    server.start()
    yield {"alfworld": root / "alfworld", "experts": experts, "url": server.url}
    server.stop()


def _overrides(preset: Path, sources: dict, model: Path) -> list[str]:
    cfg = load_config(preset)
    over = [f"model.path={model}"]
    if cfg.env.expert_source == "file":
        files = ", ".join(f"{d}: {sources['experts'][d]}" for d in cfg.domains())
        over.append(f"env.expert_files={{{files}}}")
    if cfg.env.alfworld.games == "official" and "alfworld" in cfg.domains():
        over.append(f"env.alfworld.data={sources['alfworld']}")
    if cfg.env.webshop.backend == "http":
        over.append(f"env.webshop.url={sources['url']}")
    return over


# The paper presets of other sizes differ from the 8B ones only in the model and its sizes, the 8B one on
# one node only in its cluster: their dry runs (~8 s each) run with -m slow; every preset's config is
# still validated by test_cluster_presets.
OTHER_SIZES = ("paper-qwen3-1.7b-", "paper-qwen3-4b-", "paper-qwen3-14b-within", "paper-qwen3-14b-cross.yaml",
               "paper-qwen3-8b-within-1node")  # fmt: skip


def _preset_param(p: Path):
    slow = any(p.name.startswith(prefix) or p.name == prefix for prefix in OTHER_SIZES)
    return pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", [_preset_param(p) for p in PRESETS])
def test_every_preset_passes_the_dry_run(preset: Path, sources, qwen3_folder, capsys) -> None:
    if preset.stem.startswith("sweep"):
        assert (
            "grid:" in preset.read_text()
        )  # a sweep: expands to stream configs (its base, tiny.yaml, is tested)
        return
    rc = _cli()(["--config", str(preset), "--dry-run", *_overrides(preset, sources, qwen3_folder)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    cfg = load_config(preset)
    assert f"tokenizer: {qwen3_folder}" in out.out
    for domain in cfg.domains():
        assert f"=== {domain}: expert trajectory" in out.out
    assert out.out.count("--- training example") == len(cfg.domains())
    assert out.out.count("--- inference prompt") == len(cfg.domains())
    assert "<|im_start|>user" in out.out and "=== resource plan" in out.out
    for line in ("ScienceWorld simulator", "scienceworld experts"):
        assert line in out.out


def test_a_paper_preset_dry_run_needs_a_key(sources, qwen3_folder, monkeypatch, capsys) -> None:
    """paper-* binds 0.0.0.0: without a key the dry run refuses naming both ways to give one; with
    HAMO_API_KEY it passes, says the endpoint is guarded, and never prints the key."""
    preset = ROOT / "jobs" / "configs" / "paper-qwen3-8b-within.yaml"
    over = _overrides(preset, sources, qwen3_folder)
    monkeypatch.delenv("HAMO_API_KEY")
    rc = _cli()(["--config", str(preset), "--dry-run", *over])
    out = capsys.readouterr()
    assert rc == 2 and "serve.api_key" in out.err and "HAMO_API_KEY" in out.err, out.err
    assert "dry run:" not in out.out  # refused before any work
    monkeypatch.setenv("HAMO_API_KEY", "dry-run-key-4711")
    rc = _cli()(["--config", str(preset), "--dry-run", *over])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "endpoint: 0.0.0.0:8000 (other machines too), every route behind the API key" in out.out
    assert "dry-run-key-4711" not in out.out + out.err


def test_dry_run_report_counts_tokens_against_the_limits(sources, qwen3_folder) -> None:
    preset = ROOT / "jobs" / "configs" / "paper-qwen3-8b-cross.yaml"
    lines: list[str] = []
    cfg = load_config(preset, [*_overrides(preset, sources, qwen3_folder), "train.max_seq_len=64"])
    report = dry_run(cfg, lines.append)
    assert set(report.tokens) == {"scienceworld", "alfworld", "webshop"}
    assert all(c["train"] > 64 and c["infer"] > 0 for c in report.tokens.values())
    assert any("exceed train.max_seq_len 64" in w for w in report.warnings)
    assert report.requested["GPU"] == 4 + 8 and any("GPU at peak" in w for w in report.warnings)
    text = "\n".join(lines)
    assert "/ train.max_seq_len 64" in text and "model.max_model_len 8192" in text
    # the imported trajectory's last step is the training example; its put command in the game's form
    assert "Action: move cd 1 to box 1" in text and "in/on" not in text


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_missing_sources_fail_naming_them(sources, qwen3_folder, tmp_path: Path, capsys) -> None:
    preset = ROOT / "jobs" / "configs" / "paper-qwen3-4b-cross.yaml"
    base = _overrides(preset, sources, qwen3_folder)
    dead = _closed_port_url()
    bad_item = write(tmp_path / "bad.json", [{"id": "12_0", "conversations": "none"}])
    cases = [
        ([f"env.webshop.url={dead}"], f"env.webshop.url: the WebShop env server {dead} is unreachable"),
        ([f"env.alfworld.data={tmp_path / 'nothing'}"], f"env.alfworld.games=official: no official ALFWorld games under {tmp_path / 'nothing'}"),
        ([f"env.expert_files={{scienceworld: {tmp_path / 'no.json'}, alfworld: x, webshop: y}}"], f"env.expert_files.scienceworld: {tmp_path / 'no.json'} does not exist"),
        ([f"env.expert_files={{scienceworld: {sources['experts']['scienceworld']}}}"], "env.expert_files has no file for domain 'alfworld'"),
        ([f"env.expert_files={{scienceworld: {bad_item}, alfworld: x, webshop: y}}"], f"expert file {bad_item}: item 0: field 'conversations'"),
        (["env.expert_source=simulator"], "env.expert_source=simulator: the real WebShop (env.webshop.backend=http) has no expert"),
        (["env.webshop.backend=text_env"], "env.webshop.backend=text_env: `web_agent_site` is not importable"),
    ]  # fmt: skip
    main = _cli()
    for extra, expected in cases:
        rc = main(["--config", str(preset), "--dry-run", *base, *extra])
        err = capsys.readouterr().err
        assert rc == 2 and expected in err, (extra, err)


def test_cli_exit_status_and_stderr(sources, qwen3_folder, tmp_path: Path) -> None:
    preset = ROOT / "jobs" / "configs" / "tiny-cross.yaml"
    proc = subprocess.run(
        [sys.executable, "jobs/stream.py", "--config", str(preset), "--dry-run", "env.alfworld.games=official",
         f"env.alfworld.data={tmp_path / 'missing'}", f"model.path={qwen3_folder}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (
        proc.returncode == 2
        and "env.alfworld.games=official" in proc.stderr
        and str(tmp_path / "missing") in proc.stderr
    )


def test_stream_stops_before_any_work_on_a_missing_source(tmp_path: Path) -> None:
    from hamo_ray.config import ConfigError
    from hamo_ray.run.stream import Stream

    runs = tmp_path / "runs"
    cases = [
        (
            ["env.alfworld.games=official", f"env.alfworld.data={tmp_path / 'none'}"],
            "env.alfworld.games=official",
        ),
        (["env.webshop.backend=http", f"env.webshop.url={_closed_port_url()}"], "is unreachable"),
        (["env.expert_source=file"], "env.expert_files has no file for domain 'scienceworld'"),
    ]
    for extra, expected in cases:
        cfg = load_config(ROOT / "jobs" / "configs" / "tiny-cross.yaml", [*extra, f"run.root={runs}"])
        with pytest.raises(ConfigError, match=expected):
            Stream(cfg)
    assert not runs.exists()  # nothing was started or written


def test_an_expert_file_without_usable_items_is_named(sources, qwen3_folder, capsys) -> None:
    preset = ROOT / "jobs" / "configs" / "paper-qwen3-4b-within.yaml"
    path = sources["experts"]["scienceworld"]  # its one item is a boil task
    rc = _cli()(
        [
            "--config",
            str(preset),
            "--dry-run",
            *_overrides(preset, sources, qwen3_folder),
            "env.task_types=[melt]",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and f"env.expert_files.scienceworld: {path} has no scored item of a train task" in err


def test_embedded_backbone_not_built_renders_without_token_counts(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "jobs" / "configs" / "tiny.yaml", [f"backbone.cache_dir={tmp_path}"])
    lines: list[str] = []
    report = dry_run(cfg, lines.append)
    text = "\n".join(lines)
    assert "the embedded backbone is not built yet" in text and "characters" in text
    assert report.tokens == {"scienceworld": {}} and "[target] " in text
    assert not any(tmp_path.iterdir())  # nothing was built
