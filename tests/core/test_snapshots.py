"""ema_lab.snapshots: a saved step is complete or absent whatever happens to the writer (SIGKILL at random
moments, a full disk, a second writer), files get the umask's mode, and every bad file or folder is refused
with one line naming it."""

from __future__ import annotations

import errno
import json
import os
import pickle
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ema_lab import snapshots
from ema_lab.posthoc import synthesize
from ema_lab.snapshots import MAX_STEP, Snapshot, check_folder, list_snapshots, load_snapshot, save_step

ROOT = Path(__file__).resolve().parents[2]
GAMMAS = (6.94, 16.97)


def states(value: float, n: int = 8) -> dict[float, dict[str, torch.Tensor]]:
    """Both profiles of one update, every float entry ``value`` (a reader can tell whose and which step)."""
    return {g: {"w": torch.full((n,), float(value)), "count": torch.tensor(int(value))} for g in GAMMAS}


def run_python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def one_line_value_error(call, *names: object) -> str:
    """Run ``call``; it must raise exactly ValueError (no internal error type), one line, naming ``names``."""
    with pytest.raises(Exception) as info:
        call()
    message = str(info.value)
    assert type(info.value) is ValueError, f"{type(info.value).__name__}: {message}"
    assert "\n" not in message
    for name in names:
        assert str(name) in message, (name, message)
    return message


def test_save_list_and_load(tmp_path):
    folder = check_folder(tmp_path / "new" / "run")  # parents made too
    path = save_step(folder, 7, states(7.0))
    (folder / "notes.txt").write_text("not a snapshot")
    assert path == folder / "step-000000000007"
    assert sorted(p.name for p in path.iterdir()) == ["g16.97.pt", "g6.94.pt"]
    save_step(folder, 3, states(3.0))
    listed = list_snapshots(folder)
    assert [(s.step, s.gamma) for s in listed] == [(3, 6.94), (3, 16.97), (7, 6.94), (7, 16.97)]
    assert listed[-1] == Snapshot(path / "g16.97.pt", 7, 16.97)
    tensors = load_snapshot(listed[-1])
    assert tensors["w"].tolist() == [7.0] * 8 and tensors["count"].item() == 7


def test_files_get_the_umask_mode(tmp_path):
    # torch.save of a path creates 0666 less the umask; so must a snapshot (mkstemp's 0600 would lock out
    # another user's synthesize), and its folder 0777 less the umask.
    old = os.umask(0o022)
    try:
        for umask, file_mode, dir_mode in (
            (0o022, 0o644, 0o755),
            (0o077, 0o600, 0o700),
            (0o002, 0o664, 0o775),
        ):
            os.umask(umask)
            folder = check_folder(tmp_path / f"umask{umask:o}")
            step = save_step(folder, 1, states(1.0))
            torch.save({}, folder / "reference.pt")
            assert stat.S_IMODE((folder / "reference.pt").stat().st_mode) == file_mode
            assert {stat.S_IMODE(p.stat().st_mode) for p in step.iterdir()} == {file_mode}
            assert stat.S_IMODE(step.stat().st_mode) == dir_mode
    finally:
        os.umask(old)


def test_a_saved_step_is_never_replaced(tmp_path):
    save_step(tmp_path, 5, states(1.0))
    message = one_line_value_error(
        lambda: save_step(tmp_path, 5, states(2.0)), tmp_path / "step-000000000005"
    )
    assert "never replaced" in message
    assert [load_snapshot(s)["w"][0].item() for s in list_snapshots(tmp_path)] == [1.0, 1.0]
    assert os.listdir(tmp_path) == ["step-000000000005"]  # the loser's temporary folder removed


def test_the_rename_decides_not_the_early_check(tmp_path, monkeypatch):
    # A writer that passed the early exists() check while another published the step must still lose:
    # the rename itself refuses a folder that holds files (no check-then-rename window).
    save_step(tmp_path, 5, states(1.0))
    monkeypatch.setattr(Path, "exists", lambda self: False)
    monkeypatch.setattr(Path, "is_symlink", lambda self: False)
    one_line_value_error(lambda: save_step(tmp_path, 5, states(2.0)), tmp_path / "step-000000000005")
    monkeypatch.undo()
    assert [load_snapshot(s)["w"][0].item() for s in list_snapshots(tmp_path)] == [1.0, 1.0]
    assert os.listdir(tmp_path) == ["step-000000000005"]


# The kill scripts' shared part: fork a child that runs ``work(told)`` (it writes a byte to ``told`` once
# under way), SIGKILL it ``delay`` seconds later, and return its wait status.
KILL_WHILE = """
import os, signal, time


def kill_while(work, delay):
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            work(told)
        except BaseException:
            import traceback
            traceback.print_exc()
        os._exit(1)
    os.read(ready, 1)  # the child is under way (or dead: then waitpid below says so)
    os.close(ready)
    os.close(told)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]
"""

KILLER = """
import itertools, json, os, random, signal, sys, time
import torch
from ema_lab.snapshots import check_folder, list_snapshots, load_snapshot, save_step

torch.set_num_threads(1)
root, kills, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
GAMMAS = (6.94, 16.97)
folders = [check_folder(f"{root}/run{i}") for i in range(4)]
rng = random.Random(seed)


def value(snapshot):
    tensors = load_snapshot(snapshot)
    w = tensors["w"]
    assert (w == snapshot.step).all() and tensors["g"].item() == snapshot.gamma, snapshot
    return snapshot.step


def writer(folder, ready):
    # A run that resumes from its last complete step (read back as a resume would), says it is ready, then
    # saves the next ones, as fast as it can, until it is killed.
    listed = list_snapshots(folder)
    last = value(listed[-1]) if listed else 0
    os.write(ready, b"1")
    for step in itertools.count(last + 1):
        w = torch.full((256,), float(step))
        save_step(folder, step, {g: {"w": w, "g": torch.tensor(g, dtype=torch.float64)} for g in GAMMAS})


def complete_steps(folder, checked):
    # Every listed step holds both profiles, the steps run 1..last, the new ones and the last hold their step.
    listed = list_snapshots(folder)
    steps = [s.step for s in listed]
    last = steps[-1] if steps else 0
    assert steps == [n for n in range(1, last + 1) for _ in GAMMAS], (folder, steps)
    assert [s.gamma for s in listed] == list(GAMMAS) * last, folder
    for s in listed:
        if s.step > checked or s.step == last:
            value(s)
    return last


start = time.perf_counter()
last = [0] * len(folders)
mid_save = 0
for kill in range(kills):
    i = kill % len(folders)
    before = {p for p in os.listdir(folders[i]) if p.endswith(".tmp")}
    status = kill_while(lambda told: writer(folders[i], told), rng.uniform(0, 0.06))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the writer ended: {status}"
    mid_save += len({p for p in os.listdir(folders[i]) if p.endswith(".tmp")} - before)
    last[i] = complete_steps(folders[i], last[i])
for folder in folders:  # every file of every folder, read back once more
    complete_steps(folder, 0)
print(json.dumps({"kills": kills, "last steps": last, "killed inside a save": mid_save,
                  "seconds": time.perf_counter() - start}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks its writers (POSIX only)")
def test_random_kills_leave_complete_steps_only(tmp_path):
    # 200 SIGKILLs at random moments (0-60 ms after a writer resumed; a save takes a few ms to tens of ms),
    # round-robin over 4 folders: after each, the folder lists complete steps 1..last only and its last step
    # loads; the next writer resumes from it. "killed inside a save" counts the kills that left a hidden
    # temporary folder (a save begun and not published): the kills did land mid-save.
    proc = run_python(KILL_WHILE + KILLER, str(tmp_path), "200", "45")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.splitlines()[-1])
    print(result)
    assert result["kills"] == 200 and min(result["last steps"]) > 0
    assert result["killed inside a save"] > 0


RESUMER = """
import json, os, random, signal, sys, time
import torch
from torch import nn
from ema_lab import PostHocEMA
from ema_lab.posthoc import synthesize
from ema_lab.snapshots import list_snapshots

torch.set_num_threads(1)
folder, kills = sys.argv[1], int(sys.argv[2])
rng = random.Random(int(sys.argv[3]))


def resumed():
    # A PostHocEMA of a fresh model, resumed from the folder's last complete step (as a restarted run does).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    listed = list_snapshots(folder)
    return model, PostHocEMA(model, folder, snapshot_every=1, updates=listed[-1].step if listed else 0)


def train(told):
    model, ema = resumed()
    os.write(told, b"1")
    while True:  # train and update; every update saves a step
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        ema.update(model)


last = []
for kill in range(kills):
    status = kill_while(train, rng.uniform(0, 0.2))
    assert os.WIFSIGNALED(status), f"the run ended by itself: {status}"
    _, ema = resumed()  # refused before, in 6 of 20 kills, when a step had one profile's file
    last.append(ema.updates)
    if ema.updates:
        synthesize(folder, 0.075)
print(json.dumps({"kills": kills, "resumed at": last}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks its runs (POSIX only)")
def test_a_post_hoc_run_killed_at_random_resumes_from_its_last_step(tmp_path):
    proc = run_python(KILL_WHILE + RESUMER, str(tmp_path), "20", "7")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    resumed_at = json.loads(out.splitlines()[-1])["resumed at"]
    print({"resumed at": resumed_at})
    assert resumed_at == sorted(resumed_at) and resumed_at[-1] > 0


def full_disk_checks(folder: Path, fill) -> None:
    """``fill()`` makes writes fail with a full disk and returns an undo; then: the error names the step's
    path and the OS error on one line, nothing is visible, and a retry once space is back saves it whole."""
    save_step(folder, 1, states(1.0))
    undo = fill()
    with pytest.raises(OSError) as info:
        save_step(folder, 2, states(2.0, n=4096))
    message = str(info.value)
    assert "\n" not in message and str(folder / "step-000000000002") in message, message
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG) and os.strerror(info.value.errno) in message
    assert "enforce fail" not in message
    assert os.listdir(folder) == ["step-000000000001"]  # nothing partial, not even a hidden temporary
    assert [s.step for s in list_snapshots(folder)] == [1, 1]
    undo()
    save_step(folder, 2, states(2.0, n=4096))
    assert [load_snapshot(s)["w"][0].item() for s in list_snapshots(folder)] == [1.0, 1.0, 2.0, 2.0]


@pytest.mark.skipif(sys.platform != "linux", reason="mounts a tmpfs (Linux)")
def test_disk_full_on_a_real_small_tmpfs(tmp_path):
    # A 256 KiB tmpfs filled by another file: the kernel's own ENOSPC, on write() (not a patched call).
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root; this runs as uid {os.geteuid()}")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed here: {done.stderr.decode().strip()}")
    try:
        folder = check_folder(mount / "snapshots")

        def fill():
            filler = mount / "filler"
            fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(fd, b"\0" * 4096)
            os.close(fd)
            return filler.unlink

        full_disk_checks(folder, fill)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


FSIZE = """
import resource, signal, sys
from pathlib import Path
import torch
from ema_lab.snapshots import save_step
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    save_step(sys.argv[1], 2, {g: {"w": torch.full((4096,), 2.0)} for g in (6.94, 16.97)})
except OSError as e:
    print(repr(type(e).__name__), e.errno, str(e))
"""


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_a_file_size_limit_fails_the_write_like_a_full_disk(tmp_path):
    # Where no tmpfs can be mounted (not root): RLIMIT_FSIZE makes the kernel fail write() with EFBIG.
    save_step(tmp_path, 1, states(1.0))
    proc = run_python(FSIZE, str(tmp_path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    name, code, message = out.strip().split(" ", 2)
    assert int(code) == errno.EFBIG and str(tmp_path / "step-000000000002") in message, out
    assert os.strerror(errno.EFBIG) in message and "enforce fail" not in message
    assert os.listdir(tmp_path) == ["step-000000000001"]
    save_step(tmp_path, 2, states(2.0))  # the retry, without the limit
    assert [s.step for s in list_snapshots(tmp_path)] == [1, 1, 2, 2]


def test_a_full_disk_reported_by_fsync(tmp_path, monkeypatch):
    # A filesystem with delayed allocation may accept the writes and report ENOSPC at fsync.
    real = os.fsync

    def fill():
        def full(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", full)
        return lambda: monkeypatch.setattr(os, "fsync", real)

    full_disk_checks(tmp_path, fill)


WRITER = """
import json, sys, time
from pathlib import Path
import torch
from ema_lab.snapshots import save_step
shared, own, me, steps = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
Path(shared, f".ready{me}").touch()
while not Path(shared, ".go").exists():
    time.sleep(0.001)
won, lost = [], []
for step in range(1, steps + 1):
    tensors = {g: {"w": torch.full((4096,), me)} for g in (6.94, 16.97)}
    try:
        save_step(shared, step, tensors)
        won.append(step)
    except ValueError as e:
        assert "\\n" not in str(e) and f"step-{step:012d}" in str(e), str(e)
        lost.append(step)
    save_step(own, step, tensors)
print(json.dumps({"won": won, "lost": lost}))
"""


def test_two_writers_one_wins_each_step_and_a_reader_sees_complete_steps(tmp_path):
    # Two processes (every DDP rank) save the same steps at the same moment into one shared folder, and each
    # into its own (the documented rule). In the shared one each step is won by exactly one process, whose
    # every profile it holds; the other gets a one-line ValueError, and nothing is lost. Meanwhile this
    # process reads the shared folder in a loop: it sees complete steps only, each holding one writer's.
    steps, shared = 40, check_folder(tmp_path / "shared")
    own = [check_folder(tmp_path / f"rank{r}") for r in (0, 1)]
    procs = [run_python(WRITER, str(shared), str(f), str(me), str(steps)) for me, f in zip((1.0, 2.0), own)]
    deadline = time.monotonic() + 120
    while not all((shared / f".ready{me}").exists() for me in (1.0, 2.0)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    (shared / ".go").touch()
    reads = 0
    while True:
        done = all(p.poll() is not None for p in procs)
        listed = list_snapshots(shared)
        for step in {s.step for s in listed}:
            profiles = [s for s in listed if s.step == step]
            assert [s.gamma for s in profiles] == list(GAMMAS)
            assert len({load_snapshot(s)["w"][0].item() for s in profiles}) == 1  # one writer's
            reads += 1
        if done:
            break
    a, b = (json.loads(p.communicate()[0]) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr.read()[-3000:] for p in procs]
    assert sorted(a["won"] + b["won"]) == sorted(a["lost"] + b["lost"]) == list(range(1, steps + 1))
    owner = {s: 1.0 for s in a["won"]} | {s: 2.0 for s in b["won"]}
    listed = list_snapshots(shared)
    assert [s.step for s in listed] == [n for n in range(1, steps + 1) for _ in GAMMAS]
    assert all((load_snapshot(s)["w"] == owner[s.step]).all() for s in listed)
    assert not [p for p in shared.iterdir() if p.name.endswith(".tmp")]
    for me, f in zip((1.0, 2.0), own):  # a folder each: every step saved
        assert [s.step for s in list_snapshots(f)] == [n for n in range(1, steps + 1) for _ in GAMMAS]
        assert all((load_snapshot(s)["w"] == me).all() for s in list_snapshots(f))
    print({"steps won": (len(a["won"]), len(b["won"])), "reads while writing": reads})


def test_check_folder_refuses_what_it_cannot_write(tmp_path):
    a_file = tmp_path / "a file"
    a_file.write_text("x")
    one_line_value_error(lambda: check_folder(a_file), a_file)
    one_line_value_error(lambda: check_folder(a_file / "below"), a_file / "below")
    assert (
        check_folder(tmp_path / "x" / "y") == tmp_path / "x" / "y" and os.listdir(tmp_path / "x" / "y") == []
    )


def as_another_user(call) -> str:
    """``call()`` in a forked child that is not root (as root every permission check passes: the child
    becomes "nobody"); what it raised, as "Type: message", or "returned"."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports whatever happens, then leaves without running pytest's exit code
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            call()
            report = "returned"
        except BaseException as e:  # noqa: BLE001
            report = f"{type(e).__name__}: {e}"
        os.write(write, report.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as r:
        return r.read()


@pytest.fixture
def shared_dir():
    """A folder that another user can reach (tmp_path's parents are 0700), removed afterwards."""
    folder = Path(tempfile.mkdtemp())
    os.chmod(folder, 0o755)
    yield folder
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o755)
    shutil.rmtree(folder)


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="checks as another user through fork (POSIX)")


@needs_fork
def test_check_folder_refuses_a_read_only_folder(shared_dir):
    os.chmod(shared_dir, 0o555)
    report = as_another_user(lambda: check_folder(shared_dir))
    assert report.startswith("ValueError: ") and str(shared_dir) in report and "Permission denied" in report
    assert "\n" not in report, report


@needs_fork
def test_unreadable_snapshots_are_one_line_naming_them(shared_dir):
    step = save_step(shared_dir, 1, states(1.0))
    snapshot = list_snapshots(shared_dir)[0]
    os.chmod(step, 0o000)  # its reader (not root, not the owner's rights) cannot list it
    report = as_another_user(lambda: list_snapshots(shared_dir))
    assert report.startswith("ValueError: ") and str(step) in report and "Permission denied" in report, report
    os.chmod(step, 0o755)
    os.chmod(snapshot.path, 0o000)
    report = as_another_user(lambda: load_snapshot(snapshot))
    assert report.startswith("ValueError: ") and str(snapshot.path) in report and "\n" not in report, report


def test_check_folder_gives_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_folder("run") == tmp_path / "run"


def test_an_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    save_step(tmp_path, 1, states(1.0))
    real = torch.save
    calls = []

    def interrupted(obj, f):
        calls.append(1)
        if len(calls) == 2:  # the second profile: the first one is written already
            raise KeyboardInterrupt
        real(obj, f)

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_step(tmp_path, 2, states(2.0))
    assert os.listdir(tmp_path) == ["step-000000000001"]
    save_step(tmp_path, 2, states(2.0))
    assert [s.step for s in list_snapshots(tmp_path)] == [1, 1, 2, 2]


def save_bad(tmp_path: Path, name: str, write) -> Snapshot:
    """A file ``tmp_path/step-000000000005/<name>`` written by ``write(path)``, as list_snapshots sees it."""
    step_dir = tmp_path / "step-000000000005"
    step_dir.mkdir(exist_ok=True)
    write(step_dir / name)
    return next(s for s in list_snapshots(tmp_path) if s.path.name == name)


class Foreign:
    """A pickled object that is no tensor (torch's safe loader refuses it)."""


def truncated(path: Path) -> None:
    torch.save(
        {"format": snapshots.FORMAT, "step": 5, "gamma": 1.0, "tensors": {"w": torch.ones(1000)}}, path
    )
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BAD_FILES = {
    "truncated": truncated,
    "empty": lambda p: p.write_bytes(b""),
    "text": lambda p: p.write_text("hello"),
    "a plain pickle": lambda p: p.write_bytes(pickle.dumps({"w": 1})),
    "a foreign object": lambda p: torch.save(Foreign(), p),
    "a bare state_dict": lambda p: torch.save({"w": torch.ones(2)}, p),
    "a list": lambda p: torch.save([torch.ones(2)], p),
    "another format": lambda p: torch.save({"format": "x", "step": 5, "gamma": 1.0, "tensors": {}}, p),
    "a tensor format": lambda p: torch.save(
        {"format": torch.ones(3), "step": 5, "gamma": 1.0, "tensors": {"w": torch.ones(2)}}, p
    ),
    "tensors not a dict": lambda p: torch.save(
        {"format": snapshots.FORMAT, "step": 5, "gamma": 1.0, "tensors": [torch.ones(2)]}, p
    ),
    "no tensors": lambda p: torch.save(
        {"format": snapshots.FORMAT, "step": 5, "gamma": 1.0, "tensors": {}}, p
    ),
    "a tensor step": lambda p: torch.save(
        {
            "format": snapshots.FORMAT,
            "step": torch.ones(30, 30),
            "gamma": 1.0,
            "tensors": {"w": torch.ones(2)},
        },
        p,
    ),
    "another step": lambda p: torch.save(
        {"format": snapshots.FORMAT, "step": 6, "gamma": 1.0, "tensors": {"w": torch.ones(2)}}, p
    ),
    "another gamma": lambda p: torch.save(
        {"format": snapshots.FORMAT, "step": 5, "gamma": 2.0, "tensors": {"w": torch.ones(2)}}, p
    ),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_a_bad_snapshot_file_is_one_line_naming_it(tmp_path, kind):
    snapshot = save_bad(tmp_path, "g1.0.pt", BAD_FILES[kind])
    one_line_value_error(lambda: load_snapshot(snapshot), snapshot.path)
    one_line_value_error(lambda: synthesize(tmp_path, gamma=1.0), snapshot.path)


def test_another_models_snapshots_in_one_synthesis_are_refused(tmp_path):
    save_step(tmp_path, 10, {1.0: {"w": torch.ones(2)}})
    save_step(tmp_path, 20, {1.0: {"v": torch.ones(2)}})
    save_step(tmp_path, 30, {1.0: {"w": torch.ones(3)}})
    save_step(tmp_path, 40, {1.0: {"w": torch.ones(1)}})  # would broadcast into (2,) silently
    save_step(tmp_path, 50, {1.0: {"w": torch.ones(2, dtype=torch.int64)}})
    first = tmp_path / "step-000000000010" / "g1.0.pt"
    for step, why in ((20, "missing ['w'], extra ['v']"), (30, "(3,)"), (40, "(1,)"), (50, "not float")):
        shutil.copytree(tmp_path / f"step-{step:012d}", tmp_path / "only" / f"step-{step:012d}")
        shutil.copytree(
            tmp_path / "step-000000000010", tmp_path / "only" / "step-000000000010", dirs_exist_ok=True
        )
        bad = tmp_path / "only" / f"step-{step:012d}" / "g1.0.pt"
        message = one_line_value_error(lambda: synthesize(tmp_path / "only", gamma=1.5), bad)
        assert why in message and "another model" in message, message
        shutil.rmtree(tmp_path / "only")
    assert first.exists()


def test_names_like_snapshots_that_are_no_files_are_refused(tmp_path):
    # A FIFO would block torch.load forever; a folder or a dangling link would fail it later.
    save_step(tmp_path, 1, states(1.0))
    step_dir = tmp_path / "step-000000000002"
    step_dir.mkdir()
    fifo = step_dir / "g1.0.pt"
    os.mkfifo(fifo)
    one_line_value_error(lambda: list_snapshots(tmp_path), fifo, "not a regular file")
    fifo.unlink()
    (step_dir / "g1.0.pt").symlink_to(tmp_path / "missing.pt")
    one_line_value_error(lambda: list_snapshots(tmp_path), step_dir / "g1.0.pt", "not a regular file")
    shutil.rmtree(step_dir)
    (tmp_path / "step-000000000003").write_text("a file named like a step")
    one_line_value_error(lambda: list_snapshots(tmp_path), tmp_path / "step-000000000003", "not a folder")


def test_a_link_named_like_a_snapshot_is_read_for_what_it_holds(tmp_path):
    # A link to a regular file is followed, and what the file holds must agree with the link's name.
    save_step(check_folder(tmp_path / "other"), 1, states(1.0))
    run = check_folder(tmp_path / "run")
    save_step(run, 1, states(1.0))
    (run / "step-000000000002").mkdir()
    link = run / "step-000000000002" / "g6.94.pt"
    link.symlink_to(tmp_path / "other" / "step-000000000001" / "g6.94.pt")
    snapshot = next(s for s in list_snapshots(run) if s.step == 2)
    one_line_value_error(lambda: load_snapshot(snapshot), link, "name says step 2")
    # A link named like a step, to a folder of the same step elsewhere, reads as that step.
    other_run = check_folder(tmp_path / "run2")
    (other_run / "step-000000000001").symlink_to(tmp_path / "other" / "step-000000000001")
    assert [load_snapshot(s)["w"][0].item() for s in list_snapshots(other_run)] == [1.0, 1.0]
    one_line_value_error(lambda: save_step(other_run, 1, states(2.0)), "never replaced")


def test_a_folder_deleted_mid_run(tmp_path):
    folder = check_folder(tmp_path / "run")
    save_step(folder, 1, states(1.0))
    listed = list_snapshots(folder)
    shutil.rmtree(folder)
    one_line_value_error(lambda: save_step(folder, 2, states(2.0)), folder, "was it deleted")
    one_line_value_error(lambda: load_snapshot(listed[0]), listed[0].path)
    one_line_value_error(lambda: list_snapshots(folder), folder)
    one_line_value_error(lambda: synthesize(folder, 0.1), folder)
    assert not folder.exists()  # a save never makes it again: the run's earlier snapshots are gone


def test_huge_and_odd_step_numbers(tmp_path):
    save_step(tmp_path, MAX_STEP, states(1.0))
    assert {s.step for s in list_snapshots(tmp_path)} == {MAX_STEP}
    one_line_value_error(lambda: save_step(tmp_path, MAX_STEP + 1, states(1.0)), "2**53")
    for digits in ("0" * 12, "9" * 17, "1" * 240):  # 240: about the longest name a filesystem takes
        odd = tmp_path / f"step-{digits}"
        odd.mkdir()
        started = time.perf_counter()
        one_line_value_error(lambda: list_snapshots(tmp_path), odd.name[:40])  # noqa: B023
        assert time.perf_counter() - started < 1.0
        odd.rmdir()


def test_a_folder_in_the_layout_before_step_folders_is_refused_by_name(tmp_path):
    old = tmp_path / "ema-000000000010-g6.94.pt"
    torch.save({"step": 10, "gamma": 6.94, "tensors": {"w": torch.ones(2)}}, old)
    one_line_value_error(lambda: list_snapshots(tmp_path), old, "layout before step folders")


def test_a_file_of_an_older_format_is_refused_by_its_format(tmp_path):
    # An older format may hold other fields: the message names the format, not "not a snapshot file".
    older = {"format": "ema_lab snapshot 2", "step": 5, "gamma": 1.0, "tensors": {"w": torch.ones(2)}}
    snapshot = save_bad(tmp_path, "g1.0.pt", lambda p: torch.save({**older, "extra": 1}, p))
    message = one_line_value_error(lambda: load_snapshot(snapshot), snapshot.path)
    assert "'ema_lab snapshot 2'" in message and snapshots.FORMAT in message, message


def test_save_step_bad_input_one_line(tmp_path):
    cases = [
        (lambda: save_step(tmp_path, 1, {}), "non-empty dict"),
        (lambda: save_step(tmp_path, 1, [torch.ones(1)]), "non-empty dict"),
        (lambda: save_step(tmp_path, 1, {1.0: {}}), "non-empty dict"),
        (lambda: save_step(tmp_path, 1, {1.0: {"w": [1.0]}}), "map names to Tensors"),
        (lambda: save_step(tmp_path, 1, {1.0: {"w": torch.ones(1, device="meta")}}), "Tensors with data"),
        (lambda: save_step(tmp_path, 0, {1.0: {"w": torch.ones(1)}}), "step must be an int in [1, 2**53]"),
        (lambda: save_step(tmp_path, True, {1.0: {"w": torch.ones(1)}}), "step must be"),
        (lambda: save_step(tmp_path, 1.0, {1.0: {"w": torch.ones(1)}}), "step must be"),
        (lambda: save_step(tmp_path, 1, {float("inf"): {"w": torch.ones(1)}}), "gamma must be"),
        (lambda: save_step(tmp_path, 1, {-1.0: {"w": torch.ones(1)}}), "gamma must be"),
        (lambda: save_step(tmp_path / "missing", 1, {1.0: {"w": torch.ones(1)}}), "no snapshot folder"),
        (lambda: list_snapshots(tmp_path / "missing"), "no snapshot folder"),
    ]
    for call, message in cases:
        one_line_value_error(call, message)
    assert os.listdir(tmp_path) == []
