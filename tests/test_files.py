"""Atomic writes and the command line's light start."""
import errno
import os
import subprocess
import sys

import pytest

from cifarkit.core import files


@pytest.mark.unit
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    files.write_json(target, {"old": True})
    with pytest.raises(OSError) as failure:
        with files.atomic_path(target) as tmp:
            tmp.write_text('{"new": ')
            raise OSError(errno.ENOSPC, "No space left on device")
    assert failure.value.filename == str(target)  # the message names the file the user knows, not the temporary
    assert target.read_text() == '{\n  "old": true\n}\n'
    assert os.listdir(tmp_path) == ["metrics.json"]


@pytest.mark.unit
def test_files_get_their_mode_whatever_the_umask(tmp_path):
    previous = os.umask(0o077)
    try:
        files.write_text(tmp_path / "a.txt", "x")
        assert os.umask(0o077) == 0o077  # writing set the file's mode, not the process umask
    finally:
        os.umask(previous)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == files.FILE_MODE


@pytest.mark.unit
def test_only_dead_writers_temporaries_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".last.pt.{dead}.0123abcd.tmp.pt"
    live = tmp_path / files.temp_name("last.pt")  # this process is alive: its temporary is being written
    other = tmp_path / f".other.pt.{dead}.0123abcd.tmp"
    for path in (stale, live, other):
        path.write_text("partial")
    files.write_text(tmp_path / "last.pt", "whole")
    assert not stale.exists() and live.exists() and other.exists()


@pytest.mark.unit
def test_portable_paths_never_name_the_machine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert files.portable(tmp_path / "runs" / "a") == "runs/a"
    assert files.portable("/somewhere/else/seed0") == "seed0"


def test_help_and_argument_errors_do_not_import_torch():
    probe = ("import sys; from cifarkit.cli import build_parser; build_parser().format_help(); "
             "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    done = subprocess.run([sys.executable, "-m", "cifarkit", "train", "--epochs", "many"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "invalid number value: 'many'" in done.stderr


def test_a_terminated_command_removes_its_temporary_folder_as_after_ctrl_c(tmp_path):
    script = ("import sys, tempfile, time\n"
              "from cifarkit.core.files import terminate_as_interrupt\n"
              "try:\n"
              "    with terminate_as_interrupt(), tempfile.TemporaryDirectory(dir=sys.argv[1]) as scratch:\n"
              "        print(scratch, flush=True)\n"
              "        time.sleep(60)\n"
              "except KeyboardInterrupt as e:\n"
              "    print(e, flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    scratch = child.stdout.readline().strip()
    assert os.path.isdir(scratch)
    child.terminate()
    assert child.stdout.readline().strip() == "stopped by SIGTERM"
    assert child.wait(timeout=30) == 0
    assert not os.path.exists(scratch) and not os.listdir(tmp_path)
