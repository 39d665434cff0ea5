"""Models by Hugging Face repo id, against a Hub stand-in (tests/hub_standin.py) on 127.0.0.1:
pull, run / quantize / convert by repo id, revisions, offline mode, resume, and each bad case."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from hub_standin import HubStandin, files_of

from dsq.cli import app

HF = "tiny-org/tiny-llama"
GGUF = "tiny-org/tiny-GGUF"
SPLIT = ("tiny-Q8_0-00001-of-00002.gguf", "tiny-Q8_0-00002-of-00002.gguf")


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_dir, tiny_gguf):
    """The stand-in serving an HF model repo (with files dsq must not fetch), a GGUF repo (one F16
    file and a Q8_0 split in two parts), a gated repo, and a repo with only .bin weights; HF_HOME
    and the token in a temp folder."""
    from huggingface_hub import constants

    with HubStandin() as server:
        model = files_of(tiny_dir("llama"))
        repo = server.repo(HF)
        repo.add({**model, "pytorch_model.bin": b"pickle", "modeling_tiny.py": b"import os",
                  "original/consolidated.pth": b"pickle", "README.md": b"# tiny"})
        repo.add({**model, "generation_config.json": b'{"v2": true}'}, ref="v2")
        gguf = tiny_gguf("qwen2", "F16").read_bytes()
        half = len(gguf) // 2
        server.repo(GGUF).add({"tiny-F16.gguf": gguf, SPLIT[0]: gguf[:half], SPLIT[1]: gguf[half:],
                               "README.md": b"# gguf"})
        server.repo("tiny-org/gated", gated=True).add({"tiny-F16.gguf": gguf})
        server.repo("tiny-org/bin-only").add({"config.json": model["config.json"], "pytorch_model.bin": b"pickle"})
        home = tmp_path / "hf"
        for k, v in {"HF_ENDPOINT": server.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub")}.items():
            monkeypatch.setenv(k, v)
        for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(k, raising=False)
        # huggingface_hub reads these once, at import
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        server.home = home / "hub"
        yield server


def _offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _pull(runner, *args):
    return runner.invoke(app, ["pull", *args])


def _snapshot_files(hub, repo: str) -> list[str]:
    root = hub.home / f"models--{repo.replace('/', '--')}" / "snapshots"
    return sorted(p.relative_to(root).as_posix().split("/", 1)[1] for p in root.rglob("*") if p.is_file())


def test_repo_ids_parse():
    from dsq.runtime.hub import parse_repo_id

    assert parse_repo_id("org/name") is not None and parse_repo_id("org/name").quant is None
    assert parse_repo_id("org/name:Q4_K_M").quant == "Q4_K_M"
    assert parse_repo_id("org/name/sub/m-Q8_0.gguf").file == "sub/m-Q8_0.gguf"
    for not_an_id in ("./org/name", "/abs/path", "~/x/y", "model.gguf", "org/name/config.json", "a/../b", "org"):
        assert parse_repo_id(not_an_id) is None, not_an_id


def test_which_files_a_repo_id_picks():
    from dsq.errors import DsqError
    from dsq.runtime.hub import parse_repo_id, pick_files

    unsloth = [".gitattributes", "README.md", "DeepSeek-R1-UD-IQ1_S.gguf", "config.json",
               *(f"Q4_K_M/DeepSeek-R1-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)),
               "UD-Q2_K_XL/DeepSeek-R1-UD-Q2_K_XL-00001-of-00002.gguf",
               "UD-Q2_K_XL/DeepSeek-R1-UD-Q2_K_XL-00002-of-00002.gguf"]
    assert pick_files(parse_repo_id("u/R1-GGUF:q4_k_m"), unsloth) == (
        "gguf", [f"Q4_K_M/DeepSeek-R1-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)])
    assert pick_files(parse_repo_id("u/R1-GGUF:UD-Q2_K_XL"), unsloth)[1][0].endswith("Q2_K_XL-00001-of-00002.gguf")
    assert pick_files(parse_repo_id("u/R1-GGUF:IQ1_S"), unsloth) == ("gguf", ["DeepSeek-R1-UD-IQ1_S.gguf"])
    assert pick_files(parse_repo_id("u/R1-GGUF:Q2_K_XL"), unsloth)[1][1].endswith("Q2_K_XL-00002-of-00002.gguf")
    with pytest.raises(DsqError) as e:
        pick_files(parse_repo_id("u/R1-GGUF:Q8_0"), unsloth)
    assert e.value.one_line() == "u/R1-GGUF has no Q8_0 GGUF. It has: IQ1_S, Q2_K_XL, Q4_K_M"
    with pytest.raises(DsqError, match="lacks its part"):
        pick_files(parse_repo_id("u/R1-GGUF:Q4_K_M"), unsloth[:-3])
    with pytest.raises(DsqError):  # Q4_K is not Q4_K_M
        pick_files(parse_repo_id("u/R1-GGUF:Q4_K"), unsloth)
    hf = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "pytorch_model.bin", "modeling_deepseek.py", "original/model.safetensors", "figures/x.png"]
    assert pick_files(parse_repo_id("d/R1"), hf) == ("hf", sorted(set(hf) - {
        "pytorch_model.bin", "modeling_deepseek.py", "original/model.safetensors", "figures/x.png"}))


def test_pull_hf_model_fetches_only_safetensors_config_and_tokenizer(runner, hub, tiny_dir):
    r = _pull(runner, HF)
    assert r.exit_code == 0, r.output
    path = Path(r.stdout.strip())
    want = sorted(files_of(tiny_dir("llama")))
    assert _snapshot_files(hub, HF) == want  # no .bin, .pth, .py, README
    assert files_of(path) == files_of(tiny_dir("llama"))
    assert not [h for m, p, h in hub.log if p.endswith((".bin", ".pth", ".py"))]


def test_pull_split_gguf_quant_fetches_every_part(runner, hub, tiny_gguf):
    r = _pull(runner, f"{GGUF}:q8_0")
    assert r.exit_code == 0, r.output
    path = Path(r.stdout.strip())
    assert path.name == SPLIT[0]
    assert _snapshot_files(hub, GGUF) == list(SPLIT)
    assert path.read_bytes() + (path.parent / SPLIT[1]).read_bytes() == tiny_gguf("qwen2", "F16").read_bytes()
    r = _pull(runner, f"{GGUF}/{SPLIT[1]}")  # naming any part fetches the whole split, first part first
    assert r.exit_code == 0 and Path(r.stdout.strip()).name == SPLIT[0], r.output


def test_run_by_repo_id_matches_the_local_file(runner, hub, tiny_gguf):
    args = ["-p", "The", "-n", "6", "-t", "0", "--json", "--ignore-eos"]
    r = runner.invoke(app, ["run", f"{GGUF}:F16", *args])
    assert r.exit_code == 0, r.output
    local = runner.invoke(app, ["run", str(tiny_gguf("qwen2", "F16")), *args])
    assert json.loads(r.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]


@pytest.mark.parametrize("argv, stdin", [
    (["chat", "-n", "2", "-t", "0"], "Hello\n/exit\n"),
    (["offload", "--vram", "1G", "--json"], None),
    (["bench", "--prompt-tokens", "8", "--gen-tokens", "2", "--repeat", "1", "--no-warmup"], None),
    (["eval", "--ctx", "32", "--max-tokens", "64", "--json"], None),
])
def test_every_command_takes_a_repo_id_and_revision(runner, hub, argv, stdin):
    r = runner.invoke(app, [argv[0], f"{GGUF}:F16", "--revision", "main", *argv[1:]], input=stdin)
    assert r.exit_code == 0, r.output
    assert hub.gets("tiny-F16.gguf")  # fetched from the Hub


def test_quantize_and_convert_from_a_repo_id(runner, hub, tmp_path, monkeypatch):
    from dsq.formats.gguf_file import GGUFFile

    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["quantize", HF, "--type", "Q8_0", "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    assert Path(r.stdout.strip()) == tmp_path / "tiny-llama-Q8_0.gguf"  # named by the repo, written here
    assert GGUFFile(tmp_path / "tiny-llama-Q8_0.gguf").describe_quant().startswith("Q8_0")
    r = runner.invoke(app, ["convert", HF, "--outtype", "f32"])
    assert r.exit_code == 0, r.output
    assert Path(r.stdout.strip()) == tmp_path / "tiny-llama.gguf"


def test_revision(runner, hub):
    main = Path(_pull(runner, HF).stdout.strip())
    r = _pull(runner, HF, "--revision", "v2")
    assert r.exit_code == 0, r.output
    v2 = Path(r.stdout.strip())
    assert v2 != main and v2.name == hub.repos[HF].refs["v2"]
    assert (v2 / "generation_config.json").read_text() == '{"v2": true}'
    r = _pull(runner, HF, "--revision", "nope")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert "has no revision nope" in r.stderr and "--revision" in r.stderr
    r = runner.invoke(app, ["run", "--revision", "v2", "-p", "x"])
    assert r.exit_code == 1 and "--revision applies to a Hugging Face repo id" in r.stderr, r.output


def test_serve_takes_a_repo_id_at_a_revision(runner, hub, monkeypatch):
    """dsq serve ORG/NAME --revision REV serves that revision's files, under the repo id as the
    model's name; --revision without a repo id is one line."""
    from dsq.serve import server

    served = []
    monkeypatch.setattr(server, "run", lambda engine, api, *a, **k: served.append((engine, api)))
    r = runner.invoke(app, ["serve", HF, "--revision", "v2", "--port", "0", "--ctx", "64", "--max-seqs", "2"])
    assert r.exit_code == 0, r.output
    ((engine, api),) = served
    assert engine.nm.ref.path.name == hub.repos[HF].refs["v2"] and api.model_id == HF
    assert (engine.nm.ref.path / "generation_config.json").read_text() == '{"v2": true}'
    r = runner.invoke(app, ["serve", "--revision", "v2", "--port", "0"])
    assert r.exit_code == 1 and "--revision applies to a Hugging Face repo id" in r.stderr, r.output
    assert r.stderr.count("\n") == 1


def test_offline_uses_the_cache_and_says_so(runner, hub, monkeypatch):
    assert _pull(runner, f"{GGUF}:F16").exit_code == 0
    assert _pull(runner, HF, "--revision", "v2").exit_code == 0
    _offline(monkeypatch)
    seen = len(hub.log)
    r = runner.invoke(app, ["run", f"{GGUF}:F16", "-p", "The", "-n", "3", "-t", "0", "--json", "--ignore-eos"])
    assert r.exit_code == 0, r.output
    assert "HF_HUB_OFFLINE=1: using the Hugging Face cache only" in r.stderr
    r = _pull(runner, HF, "--revision", "v2")
    assert r.exit_code == 0 and Path(r.stdout.strip()).name == hub.repos[HF].refs["v2"], r.output
    r = _pull(runner, HF)  # main was never fetched
    assert r.exit_code == 1 and "holds no cached copy of tiny-org/tiny-llama" in r.stderr, r.output
    assert "Unset HF_HUB_OFFLINE" in r.stderr and r.stderr.count("\n") == 1
    assert len(hub.log) == seen  # nothing asked of the Hub


def test_a_cut_connection_resumes_where_it_stopped(runner, hub, tiny_gguf, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 500)  # bytes are kept a whole chunk at a time
    hub.cut_after("tiny-F16.gguf", 1000)
    monkeypatch.delenv("DSQ_QUIET", raising=False)  # progress, as lines into a pipe
    monkeypatch.delenv("CI", raising=False)  # CI with stderr not a terminal quiets progress
    r = _pull(runner, f"{GGUF}:F16")
    assert r.exit_code == 0, r.output
    assert "downloading tiny-org/tiny-GGUF/tiny-F16.gguf ..." in r.stderr and "2.5 MiB" in r.stderr, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == tiny_gguf("qwen2", "F16").read_bytes()
    gets = hub.gets("tiny-F16.gguf")
    assert len(gets) == 2 and "range" not in gets[0] and gets[1]["range"] == "bytes=1000-"


def test_a_pull_killed_mid_file_resumes_in_the_next_run(runner, hub, tiny_gguf):
    """`dsq pull` in a child process is killed (SIGKILL: no cleanup of any kind) once the stand-in
    has sent it 1,000 bytes of the file; the next `dsq pull` asks only for the rest (a Range
    request), and the cache holds the file byte for byte, as huggingface_hub's own entry."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from huggingface_hub import hf_hub_download

    whole = tiny_gguf("qwen2", "F16").read_bytes()
    hub.stall_after("tiny-F16.gguf", 1000)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(hub.home.parent), "HF_HUB_CACHE": str(hub.home),
           "DSQ_QUIET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    small_chunks = ("import runpy, sys; import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 500; "
                    "runpy.run_module('dsq', run_name='__main__')")
    child = subprocess.Popen([sys.executable, "-c", small_chunks, "pull", f"{GGUF}:F16"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    blobs = hub.home / "models--tiny-org--tiny-GGUF" / "blobs"
    deadline = time.time() + 120
    try:
        while not any(p.stat().st_size >= 1000 for p in blobs.glob("*.incomplete")) if blobs.is_dir() else True:
            assert child.poll() is None and time.time() < deadline, child.stderr.read() if child.poll() else "slow"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
        hub.release()
    assert not list(hub.home.glob("models--*/snapshots/*/*.gguf"))
    (part,) = blobs.glob("*.incomplete")
    assert part.read_bytes() == whole[:1000]
    hub.served.clear()
    r = _pull(runner, f"{GGUF}:F16")
    assert r.exit_code == 0, r.output
    assert hub.served == [("tiny-F16.gguf", 1000, len(whole) - 1000)]
    assert hub.gets("tiny-F16.gguf")[-1]["range"] == "bytes=1000-"
    assert Path(r.stdout.strip()).read_bytes() == whole and not list(blobs.glob("*.incomplete"))
    cached = hf_hub_download(GGUF, "tiny-F16.gguf", local_files_only=True)  # huggingface_hub's own view
    assert Path(cached).resolve() == Path(r.stdout.strip()).resolve() and Path(cached).is_symlink()


@pytest.mark.parametrize("model, says", [
    ("tiny-org/gated", "tiny-org/gated is gated: the Hub refused the download (no token)"),
    ("tiny-org/bin-only", "tiny-org/bin-only has only pickled or non-safetensors weights (such as pytorch_model.bin)"),
    (f"{GGUF}:Q2_K", "tiny-org/tiny-GGUF has no Q2_K GGUF. It has: F16, Q8_0"),
    (GGUF, "tiny-org/tiny-GGUF holds several GGUF files. Pick one: tiny-org/tiny-GGUF:QUANT with QUANT one of F16, "
           "Q8_0"),
    (f"{HF}:Q4_K_M", "tiny-org/tiny-llama has no GGUF files, so no quant Q4_K_M"),
    (f"{GGUF}/other.gguf", "tiny-org/tiny-GGUF has no file other.gguf"),
])
def test_bad_repo_ids_say_one_line(runner, hub, model, says):
    for argv in (["pull", model], ["run", model, "-p", "x"]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 1, r.output
        assert r.stderr.startswith(f"error: {says}") and r.stderr.count("\n") == 1, r.stderr
    assert not list(hub.home.glob("models--*/snapshots/*/*"))  # nothing fetched


def test_a_missing_repo(runner, hub):
    r = runner.invoke(app, ["run", "nobody/nothing", "-p", "x"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert r.stderr.startswith("error: nobody/nothing is neither a local path (none here) nor a Hugging Face repo "
                               "(or it is private and no token is set). Check the spelling"), r.stderr
    r = _pull(runner, "nobody/nothing")
    assert r.exit_code == 1 and r.stderr.startswith("error: no Hugging Face repo nobody/nothing"), r.output


@pytest.mark.parametrize("where", ["HF_TOKEN", "hf auth login"])
def test_gated_repo_with_a_token(runner, hub, monkeypatch, where):
    if where == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", hub.token)
    else:  # the file `hf auth login` writes
        hub.home.parent.mkdir()
        (hub.home.parent / "token").write_text(hub.token)
    r = _pull(runner, "tiny-org/gated")
    assert r.exit_code == 0, r.output
    assert Path(r.stdout.strip()).name == "tiny-F16.gguf"


def test_a_local_path_wins_over_a_repo_id(runner, hub, tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / "tiny-org" / "tiny-GGUF").write_bytes(tiny_gguf("qwen2", "F16").read_bytes())
    r = runner.invoke(app, ["run", GGUF, "-p", "The", "-n", "2", "-t", "0", "--json", "--ignore-eos"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"] == GGUF and hub.log == []


def _fail_mid_file(monkeypatch, error: BaseException) -> None:
    """The next GGUF download writes some bytes, then `error` happens."""
    from huggingface_hub import file_download

    real = file_download.http_get

    def http_get(url, temp_file, **kw):
        if url.endswith(".gguf"):
            temp_file.write(b"GGUF partial")
            monkeypatch.setattr(file_download, "http_get", real)
            raise error
        return real(url, temp_file, **kw)

    monkeypatch.setattr(file_download, "http_get", http_get)


@pytest.mark.parametrize("error, code, says", [
    (KeyboardInterrupt(), 130, "interrupted; rerun to resume the download of tiny-org/tiny-GGUF"),
    (OSError(errno.ENOSPC, "No space left on device"), 1, "error: the disk filled while fetching tiny-org/tiny-GGUF"),
])
def test_interrupt_or_full_disk_leaves_nothing_that_looks_complete(runner, hub, monkeypatch, tiny_gguf, error, code,
                                                                   says):
    _fail_mid_file(monkeypatch, error)
    r = _pull(runner, f"{GGUF}:Q8_0")
    assert r.exit_code == code, r.output
    assert r.stderr.startswith(says) and r.stderr.count("\n") == 1, r.stderr
    storage = hub.home / "models--tiny-org--tiny-GGUF"
    assert not [p for p in storage.rglob("*") if p.is_file() and p.suffix == ".gguf"]
    kept = [p for p in (storage / "blobs").iterdir()]  # only the partial, named as such
    assert len(kept) == 1 and kept[0].suffix == ".incomplete" and kept[0].read_bytes() == b"GGUF partial"
    r = _pull(runner, f"{GGUF}:Q8_0")  # the rerun resumes, finds the kept bytes are not the file's, fetches it whole
    assert r.exit_code == 0, r.output
    assert _snapshot_files(hub, GGUF) == list(SPLIT)
    gets = hub.gets(SPLIT[0])
    assert [g.get("range") for g in gets] == [f"bytes={len(b'GGUF partial')}-", None]
    whole = tiny_gguf("qwen2", "F16").read_bytes()
    assert b"".join(p.read_bytes() for p in sorted((storage / "snapshots").glob("*/*.gguf"))) == whole
    assert not list(storage.rglob("*.incomplete"))


def test_no_hub_to_reach(runner, hub, monkeypatch):
    from huggingface_hub import constants

    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    r = _pull(runner, HF)
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert r.stderr.startswith("error: the connection to http://127.0.0.1:9 failed while fetching "
                                                   "tiny-org/tiny-llama"), r.stderr
    r = runner.invoke(app, ["run", "models/tiny", "-p", "x"])  # a mistyped local path, or a repo: both tried
    assert r.exit_code == 1 and r.stderr.startswith("error: no local path models/tiny, and the connection"), r.output


def test_cache_lists_and_removes_pulled_repos(runner, hub):
    assert _pull(runner, HF).exit_code == 0
    assert _pull(runner, f"{GGUF}:F16").exit_code == 0
    r = runner.invoke(app, ["cache"])
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  tiny-org/")}
    assert set(lines) == {HF, GGUF}
    assert "main (" in lines[HF] and "MiB" in lines[GGUF]
    r = runner.invoke(app, ["cache", "--remove", GGUF])
    assert r.exit_code == 0 and "MiB freed" in r.stderr, r.output
    assert not (hub.home / "models--tiny-org--tiny-GGUF").exists()
    assert (hub.home / "models--tiny-org--tiny-llama").exists()
    r = runner.invoke(app, ["cache", "--remove", GGUF])
    assert r.exit_code == 1 and "tiny-org/tiny-GGUF is not in the Hugging Face cache" in r.stderr, r.output
    assert "It holds: tiny-org/tiny-llama" in r.stderr


def test_a_recipe_without_model_pulls_its_repo(runner, hub, tiny_dir, monkeypatch, tmp_path):
    from dsq.cli import quantize
    from dsq.quant.recipes import load_recipe

    repo = load_recipe("r1-distill-qwen-7b")["model"]
    hub.repo(repo).add(files_of(tiny_dir("qwen2")))
    got = {}
    monkeypatch.setattr(quantize, "_quantize", lambda src, target, spec, *a, **kw: got.update(src=src, target=target))
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["quantize", "--recipe", "r1-distill-qwen-7b"])
    assert r.exit_code == 0, r.output
    assert got["src"].name == hub.repos[repo].refs["main"] and files_of(got["src"]) == files_of(tiny_dir("qwen2"))
    assert got["target"].parent == tmp_path and got["target"].name.startswith(repo.split("/")[1])
