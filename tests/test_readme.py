"""The README held to what it shows, so that the front door cannot drift: every command block runs as a user runs
it (in a workspace of its own: make's artifacts there, placeholders replaced by what the tests built), and the
set-up commands' output has the shape the README shows; every Python block runs there; every make target and
every command-line flag the README names exists."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_released_checkpoint import write_released
from test_serve import free_socket

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
BIN = Path(sys.executable).parent
SHOWN_PORT = "127.0.0.1:8000"  # where the README's clients find a server
RELEASED_FOLDER = "/path/to/fox-pro-760m-longcrawl64-48b"  # the README's placeholder for a released folder
# make targets a test run does not run itself, and why: they are dry-run (`make -n`) instead
DRY_RUN = {
    "test": "it would run this suite inside itself",
    "lm-eval": "tests/test_lm_eval.py runs the same harness on fox-py document by document",
}
SERVERS = ("kvg-serve", "make serve")  # commands that serve until stopped
NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?"
PROGRESS_LINE = re.compile(r"^\S+ +\.\.\. \d+ s: ")  # a long stage's progress (exporters/progress.py), timing's


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of `language` ("" for plain ones), in order."""
    found, opened, lines = [], None, []
    for line in README.splitlines(keepends=True):
        if not line.startswith("```"):
            lines.append(line)
        elif opened is None:
            opened, lines = line[3:].strip(), []
        else:
            found += ["".join(lines)] if opened == language else []
            opened = None
    return found


def commands(block: str) -> list[str]:
    """A command block's commands: one a line, comments dropped, `&&` chains split."""
    found = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        found += [part.strip() for part in line.split("&&") if part.strip()]
    return found


def shape(shown: str) -> re.Pattern:
    """What an output block shows, with its numbers and spacing free, a line of `...` any lines, and `...` within a
    line anything."""
    lines = []
    for line in shown.strip("\n").splitlines():
        if line.strip() == "...":
            lines.append(r"(?:.*\n)*?")
            continue
        pattern = re.escape(line).replace(r"\.\.\.", ".*")
        pattern = re.sub(r"(?:\\ )+", " +", pattern)
        pattern = re.sub(r"\d+(?:\\\.\d+)?(?:e\\-\d+)?", lambda _: NUMBER, pattern)
        lines.append(pattern + r"\n")
    return re.compile("".join(lines))


def shown_output(first_word: str) -> re.Pattern:
    return shape(next(block for block in blocks("") if block.startswith(first_word)))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Where the README's commands and blocks run: make writes its artifacts here, `models` is the repository's,
    and the released-checkpoint placeholder names a folder laid out as the released ones."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "models").symlink_to(REPO / "models")
    write_released(folder / "released")
    return folder


def shell(command: str, workspace: Path) -> str:
    """`command` as the README writes it, run here: make against the repository with its artifacts in the workspace,
    placeholders replaced."""
    command = command.replace(RELEASED_FOLDER, str(workspace / "released"))
    if command.startswith("make "):
        command = f"make -s -C {REPO} --no-print-directory ARTIFACTS={workspace / 'artifacts'} {command[5:]}"
    return command


def run(command: str, workspace: Path, timeout: int = 600) -> str:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(["bash", "-c", command], cwd=workspace, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout}"
    output = done.stdout.replace(f"{workspace}/", "")
    return "".join(line + "\n" for line in output.splitlines() if not PROGRESS_LINE.match(line))


def serve(command: str, workspace: Path) -> tuple[subprocess.Popen, str]:
    """Start a serving command on a free port; returns the process and its base URL once it is healthy."""
    port = free_socket().getsockname()[1]  # closed again at once; the server binds it itself
    flag = f"SERVE_FLAGS='--port {port}'" if command.startswith("make ") else f"--port {port}"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    process = subprocess.Popen(["bash", "-c", f"exec {shell(command, workspace)} {flag}"], cwd=workspace, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        assert process.poll() is None, f"{command} ended: {process.stderr.read().decode()}"
        assert time.monotonic() < deadline, f"{command} did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(60)


def run_python(block: str, workspace: Path, url: str | None = None) -> None:
    if url is not None:
        block = block.replace(f"http://{SHOWN_PORT}", url)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", block], cwd=workspace, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{block}\n{done.stderr}"


def test_the_set_up_commands_run_and_print_what_the_readme_shows(workspace):
    setup = commands(blocks("sh")[0])
    assert setup == ["make export MODEL=fox-py", "make generate MODEL=fox-py", "make test"]
    exported = run(shell(setup[0], workspace), workspace)
    assert shown_output("load ").match(exported), exported
    generated = run(shell(setup[1], workspace), workspace)
    assert shown_output("kvg-generate: ").fullmatch(generated), generated
    run(shell("make -n test", workspace), workspace)  # the target and its command exist; it is this suite


def test_every_other_command_block_runs_and_its_clients_talk_to_its_servers(workspace):
    """Each block's commands in order; a server is started, answers a text prompt, the README's Python clients of
    the model it serves run against it, and it is stopped."""
    clients = [block for block in blocks("python") if SHOWN_PORT in block]
    assert clients, "the README shows a client of kvg-serve"
    served = []
    for block in blocks("sh")[1:]:
        for command in commands(block):
            target = command.split()[1] if command.startswith("make ") else None
            if target in DRY_RUN:
                run(shell(command.replace("make ", "make -n ", 1), workspace), workspace)
            elif command.startswith(SERVERS):
                process, url = serve(command, workspace)
                try:
                    name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                    body = {"model": name, "prompt": "def main():", "max_tokens": 8}
                    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
                    for client in clients:
                        if f'model="{name}"' in client:
                            run_python(client, workspace, url)
                            served.append(client)
                finally:
                    stop(process)
            else:
                run(shell(command, workspace), workspace)
    assert sorted(served) == sorted(clients)  # each client ran, against the server of the model it names


def test_every_python_block_runs(workspace):
    """Those that need no server; run after the set-up commands made artifacts/fox-py-dynamic-fp32."""
    if not (workspace / "artifacts" / "fox-py-dynamic-fp32").is_dir():
        run(shell("make export MODEL=fox-py", workspace), workspace)
    for block in blocks("python"):
        if SHOWN_PORT not in block:
            run_python(block, workspace)


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", README))
    assert named and named <= targets, named - targets


@pytest.mark.parametrize("command", ["kvg-export", "kvg-generate", "kvg-serve", "kvg-eval", "kvg-lm-eval"])
def test_every_flag_the_readme_names_for_a_command_is_one_it_takes(command):
    spans = re.findall(rf"`{command} ([^`]*)`", README) + [
        line for block in blocks("sh") for line in commands(block) if line.startswith(command)
    ]
    named = {flag for span in spans for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", span)}
    taken = set(re.findall(r"--[a-z][a-z-]*", run(f"{command} --help", REPO)))
    assert spans and named <= taken, sorted(named - taken)


def test_a_block_is_what_the_commands_parse(workspace):
    """The parser itself: a chained line splits, comments go, placeholders and make are rewritten."""
    assert commands("a && b   # c\n\nd\n") == ["a", "b", "d"]
    assert shell(f"kvg-export {RELEASED_FOLDER}", workspace) == f"kvg-export {workspace / 'released'}"
    assert shlex.split(shell("make export MODEL=x", workspace))[:4] == ["make", "-s", "-C", str(REPO)]
    assert shape("load   0.0 s  x ...\n...\nend").fullmatch("load 12.5 s  x and y\na\nb\nend\n")


def test_every_relative_link_in_the_documentation_resolves_inside_the_repository():
    """A clean clone is all a reader has: a link (or a path written as a sibling's, `../...`) that leaves the
    repository, or names a file it lacks, is a dead end."""
    pages = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in pages.stdout.split():
        page = REPO / name
        text = page.read_text()
        assert not re.findall(r"\.\./[\w.-]+", text), f"{name} points outside the repository"
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:|#", link):  # a web address or an anchor on the page
                continue
            target = (page.parent / link.partition("#")[0]).resolve()
            assert target.is_relative_to(REPO) and target.exists(), f"{name} links to {link}, which is not there"
