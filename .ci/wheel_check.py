"""CI installs what it built: the sdist and platform wheel built from this checkout, installed into fresh virtual
environments, run from a folder outside the checkout with no C++ compiler on PATH.

`make wheel-check` runs it (after `make test` in .ci/run). It checks, each against a fact of its own:
- the build prints no warning, and the wheel is tagged for this platform and carries the presets, the lm-eval
  tasks and the fused operator prebuilt for x86-64 and x86-64-v3 (AVX registers in the second only);
- `kvg-export fox-py` in an environment with the `export` extra exports with fused attention from the bundled
  library (the artifact's copy is byte for byte the wheel's for this CPU, and it carries the wheel's others for this
  machine, named by platform in its manifest, for the runtime to take on a CPU of another level; nothing compiled);
- `kvg-generate` prints what the README shows;
- the runtime-only install (no extras: no torch or transformers installed) runs that artifact with kvg-generate
  to the same text, and with the `serve` extra added kvg-serve answers one completion with the same greedy tokens;
- taken out of the export environment, this CPU's level's library gives way to the baseline one, and with neither
  left (and no compiler) `--attention fused` is refused and an `auto` export attends through GroupQueryAttention,
  each saying why.
Stdlib only: it runs under any python3 that has `build` (the checkout's .venv).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from runtime.custom_ops import base_tag, platform_tag  # noqa: E402  (stdlib only: this checkout's, not an installed one)

TORCH = os.environ.get("TORCH", "torch==2.13.0+cpu")  # as the Makefile's setup pins it
COMPILERS = ("c++", "g++", "gcc", "cc", "clang", "clang++")
PROMPT = "def parse_args(argv):"
NEW_TOKENS = 48
SERVE_TOKENS = 16
LIBRARY = "libkvg_fox_attention.so"


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(command: list[str], env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`command` run, echoed; exit with its output where it fails."""
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{done.stdout}{done.stderr}\nwheel check: `{' '.join(command)}` exited {done.returncode}")
    return done


def check(condition: bool, problem: str) -> None:
    if not condition:
        sys.exit(f"wheel check: {problem}")


def build(dist: Path) -> tuple[Path, Path]:
    step("build the sdist, and the wheel from it")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # its own warning, not the build's
    done = run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], env=env)
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "warning" in line.lower()]
    check(not warnings, "the build warned:\n" + "\n".join(warnings))
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    print(f"built {sdist.name}, {wheel.name}, no warnings")
    return wheel, sdist


def inspect(wheel: Path, scratch: Path) -> dict[str, Path]:
    """The wheel's prebuilt libraries by platform tag, unpacked, after checking what it must carry."""
    step("what the wheel carries")
    check(wheel.name.endswith("-py3-none-linux_x86_64.whl"), f"{wheel.name} is not tagged py3-none-linux_x86_64")
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = sorted(p.name for p in (ROOT / "models").iterdir() if (p / "preset.json").is_file())
    for preset in presets:
        for file in ("config.json", "tokenizer.json", "preset.json"):
            check(f"kvg_export/models/{preset}/{file}" in names, f"the wheel lacks {preset}'s {file}")
    for trained in ("fox-py", "fox-pro-py"):
        check(f"kvg_export/models/{trained}/model.safetensors" in names, f"the wheel lacks {trained}'s weights")
    tasks = sorted(p.name for p in (ROOT / "exporters/evaluation/lm_eval_tasks").glob("*.yaml"))
    check(all(f"exporters/evaluation/lm_eval_tasks/{t}" in names for t in tasks), "the wheel lacks lm-eval tasks")
    libraries = {}
    with zipfile.ZipFile(wheel) as archive:
        for tag in ("linux-x86_64", "linux-x86_64-x86-64-v3"):
            name = f"exporters/native/prebuilt/{tag}/{LIBRARY}"
            check(name in names, f"the wheel lacks the fused operator prebuilt for {tag}")
            libraries[tag] = Path(archive.extract(name, scratch / "unpacked"))
    if shutil.which("objdump"):  # the level each was compiled for shows in its instructions: AVX's ymm registers
        uses_ymm = {tag: "%ymm" in run(["objdump", "-d", str(path)]).stdout for tag, path in libraries.items()}
        check(uses_ymm == {"linux-x86_64": False, "linux-x86_64-x86-64-v3": True}, f"ymm registers: {uses_ymm}")
        print("objdump: ymm registers in the x86-64-v3 library only")
    print(f"{len(presets)} presets (fox-py and fox-pro-py with weights), {len(tasks)} lm-eval tasks, libraries for "
          f"{', '.join(libraries)}")  # fmt: skip
    return libraries


def install(folder: Path, *requirements: str) -> Path:
    """`requirements` installed into the virtual environment `folder` (made if missing, so fresh); its bin folder."""
    if not folder.exists():
        run([sys.executable, "-m", "venv", str(folder)])
    pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    for requirement in requirements:  # one at a time: torch's CPU wheel first, so that nothing pulls another
        run([*pip, requirement])
    return folder / "bin"


def no_compiler_env(bin_folder: Path, home: Path) -> dict[str, str]:
    """Only the environment's own bin on PATH (so no C++ compiler), and a home of its own (so no cached library)."""
    env = {"PATH": str(bin_folder), "HOME": str(home), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "2"}
    probe = f"import shutil; print([c for c in {COMPILERS!r} if shutil.which(c)])"
    found = run([str(bin_folder / "python"), "-c", probe], env=env).stdout.strip()
    check(found == "[]", f"compilers on PATH: {found}")
    print(f"PATH={env['PATH']}: no {', '.join(COMPILERS)}")
    return env


def export(bin_folder: Path, env: dict, work: Path, libraries: dict[str, Path], cache: str) -> Path:
    """kvg-export fox-py: fused attention through the wheel's library for this CPU, and the wheel's others for this
    machine carried beside it, each named in the manifest by its platform."""
    library = libraries[platform_tag()]
    out = work / f"fox-py-{cache}-fp32"
    done = run([str(bin_folder / "kvg-export"), "fox-py", "--out", out.name, "--cache", cache], env=env, cwd=work)
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("trace", "artifact", "parity"))))
    manifest = json.loads((out / "kvg_config.json").read_text())
    check(manifest["attention"] == "fused", f"the {cache} export attends through {manifest['attention']}")
    check(manifest["custom_ops"]["platform"] == platform_tag(), f"its library is for {manifest['custom_ops']}")
    check((out / LIBRARY).read_bytes() == library.read_bytes(), "its library is not the wheel's prebuilt one")
    check("fused attention" not in done.stderr, "the export did not take the prebuilt library:\n" + done.stderr)
    others = manifest["custom_ops"].get("other_platforms", {})
    check(set(others) == set(libraries) - {platform_tag()}, f"it carries {others}, not the wheel's other libraries")
    for tag, name in others.items():
        check((out / name).read_bytes() == libraries[tag].read_bytes(), f"its {tag} library is not the wheel's")
    print(f"manifest: attention fused, custom_ops {manifest['custom_ops']}; the library is the wheel's, byte for byte")
    return out


def installed_prebuilt(bin_folder: Path, env: dict) -> Path:
    where = "import exporters.native.library as l; print(l.PREBUILT)"
    return Path(run([str(bin_folder / "python"), "-c", where], env=env).stdout.strip())


def baseline(bin_folder: Path, env: dict, work: Path, library: Path) -> None:
    """With this CPU's level's library taken out of the install (as on a CPU the wheel has no level for): the export
    takes the baseline library, still with no compiler."""
    shutil.rmtree(installed_prebuilt(bin_folder, env) / platform_tag())
    out = "fox-py-baseline"
    done = run([str(bin_folder / "kvg-export"), "fox-py", "--out", out, "--attention", "fused"], env=env, cwd=work)
    manifest = json.loads((work / out / "kvg_config.json").read_text())
    check(manifest["custom_ops"]["platform"] == base_tag(), f"the library taken is for {manifest['custom_ops']}")
    check((work / out / LIBRARY).read_bytes() == library.read_bytes(), "it is not the wheel's baseline library")
    check("fused attention" not in done.stderr, "the export did not take the baseline library:\n" + done.stderr)
    print(f"manifest: attention {manifest['attention']}, platform {base_tag()}; the wheel's baseline library")


def fallback(bin_folder: Path, env: dict, work: Path) -> None:
    """With no prebuilt library left in the install (as on a platform the wheel has none for) and no compiler:
    `--attention fused` is refused and an `auto` export attends through GroupQueryAttention, each saying why."""
    shutil.rmtree(installed_prebuilt(bin_folder, env))
    export = [str(bin_folder / "kvg-export"), "fox-py", "--out", "fox-py-fallback"]
    print("$ " + " ".join([*export, "--attention", "fused"]), flush=True)
    refused = subprocess.run([*export, "--attention", "fused"], env=env, cwd=work, capture_output=True, text=True)
    print(refused.stderr.strip())
    why = "this install carries no prebuilt library"
    check(refused.returncode == 2 and why in refused.stderr and "no C++ compiler" in refused.stderr,
          f"--attention fused was not refused saying {why!r} and that there is no compiler")  # fmt: skip
    done = run(export, env=env, cwd=work)
    said = [line for line in done.stderr.splitlines() if line.startswith("fused attention:")]
    print("\n".join(said))
    check(len(said) == 1 and why in said[0] and said[0].endswith("attending through GroupQueryAttention"),
          f"the auto export did not say why it fell back:\n{done.stderr}")  # fmt: skip
    attention = json.loads((work / "fox-py-fallback" / "kvg_config.json").read_text())["attention"]
    check(attention == "gqa", f"the fallback export attends through {attention}")
    print("manifest: attention gqa")


def readme_generation() -> list[str]:
    """The lines the README shows between kvg-generate's first line and its timing line."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(kvg-generate: .*?\n)(.*?)\nkvg-generate: \d+ tokens", text, re.S)
    check(block is not None, "README.md shows no kvg-generate output")
    return block.group(2).splitlines()


def generate(bin_folder: Path, env: dict, work: Path, artifact: Path) -> str:
    command = [str(bin_folder / "kvg-generate"), artifact.name, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
    done = run(command, env=env, cwd=work)
    said = [line for line in done.stderr.splitlines() if line.startswith("kvg-generate: ")]  # on stderr, as it says
    check(len(said) == 2, f"kvg-generate said on stderr:\n{done.stderr}")
    check(said[0].startswith(f"kvg-generate: {artifact.name} on CPU (its fp32 fused FoX attention runs on the CPU"),
          f"kvg-generate's first line: {said[0]}")  # fmt: skip
    check(said[1].startswith(f"kvg-generate: {NEW_TOKENS} tokens, first after"), f"its last line: {said[1]}")
    text = done.stdout.splitlines()  # the text alone, on stdout
    check(text == readme_generation(), "kvg-generate's text is not the README's:\n" + done.stdout)
    print("\n".join([said[0], *text, said[1]]))
    print("(the text the README shows)")
    return "\n".join(text)


def serve(bin_folder: Path, env: dict, work: Path, artifact: Path, expected: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(bin_folder / "kvg-serve"), artifact.name, "--port", str(port), "--max-batch", "2"]
    print("$ " + " ".join(command), flush=True)
    log = work / "serve.log"
    with log.open("w") as sink:
        server = subprocess.Popen(command, env=env, cwd=work, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            check(server.poll() is None, f"kvg-serve exited {server.returncode}:\n{log.read_text()}")
            check(time.monotonic() < deadline, f"kvg-serve did not answer /health in 120 s:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        body = {"model": artifact.name, "prompt": PROMPT, "max_tokens": SERVE_TOKENS, "temperature": 0}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as answer:
            completion = json.loads(answer.read())
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    text, usage = completion["choices"][0]["text"], completion["usage"]
    print(f"POST /v1/completions {json.dumps(body)}\n-> {text!r}, usage {usage}")
    check(usage["completion_tokens"] == SERVE_TOKENS, f"{usage['completion_tokens']} tokens, not {SERVE_TOKENS}")
    check(expected.startswith(text), f"kvg-serve's greedy text {text!r} is not the start of kvg-generate's")
    print("(the start of kvg-generate's greedy text)")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvg-wheel-check-") as folder:
        scratch = Path(folder)
        started = time.monotonic()
        wheel, _ = build(scratch / "dist")
        libraries = inspect(wheel, scratch)
        work = scratch / "work"  # outside the checkout: the presets and the code must come from the wheel
        work.mkdir()
        os.chdir(work)  # so too for `python -c`, which would import the checkout's packages from the checkout

        step("install the wheel with the export extra (torch's CPU wheel first) into a fresh environment")
        full = install(scratch / "venv-export", TORCH, f"{wheel}[export]")
        full_env = no_compiler_env(full, scratch / "home-export")
        step("kvg-export fox-py, from a folder outside the checkout, with no compiler")
        print(run([str(full / "kvg-export"), "--version"], env=full_env).stdout.strip())
        dynamic = export(full, full_env, work, libraries, "dynamic")
        static = export(full, full_env, work, libraries, "static")
        step("kvg-generate, as the README shows it")
        expected = generate(full, full_env, work, dynamic)

        step("the runtime-only install (the wheel, no extras) into a fresh environment: no torch, no transformers")
        lean = install(scratch / "venv-runtime", str(wheel))
        lean_env = no_compiler_env(lean, scratch / "home-runtime")
        absent = "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])"
        found = run([str(lean / "python"), "-c", absent], env=lean_env).stdout.strip()
        check(found == "[]", f"the runtime-only install holds {found}")
        print("neither torch nor transformers is installed")
        check(generate(lean, lean_env, work, dynamic) == expected, "the runtime-only install generates other text")
        step("kvg-serve from the runtime-only install with the serve extra added (still no torch): one completion")
        install(scratch / "venv-runtime", f"{wheel}[serve]")
        found = run([str(lean / "python"), "-c", absent], env=lean_env).stdout.strip()
        check(found == "[]", f"the serve extra installed {found}")
        serve(lean, lean_env, work, static, expected)

        if platform_tag() != base_tag():
            step("the export environment without the library for this CPU's level: the baseline one, no compiler")
            baseline(full, full_env, work, libraries[base_tag()])
        step("the fallback: the export environment without prebuilt libraries, and no compiler")
        fallback(full, full_env, work)
        print(f"\nwheel check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
