"""Writing user files safely: atomically, and never over an existing file unless asked."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from replay.errors import OutputExistsError, SpecReplayError, TranscriptError, json_error


def refuse_existing(path: Path | str, force: bool) -> None:
    """Fail early, before any work, if `path` exists and --force was not given."""
    if not force and Path(path).exists():
        raise OutputExistsError(f"{path} exists; use --force to overwrite it")


def check_writable(path: Path | str) -> None:
    """Fail early, before any work, where `path` cannot be written, naming the reason that holds there:
    `path` is a folder; a part of its folder path is a file; a missing folder cannot be made (write_atomic
    makes the missing ones); the folder takes no new file (read-only, no permission, or a kernel
    filesystem such as /proc). Nothing is left behind.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "f").write_text("")
    >>> check_writable(d / "new" / "out.json")  # a folder that can be made
    >>> try: check_writable(d / "f" / "out.json")
    ... except SpecReplayError as e: print(str(e).replace(str(d), "D"))
    cannot write D/f/out.json: D/f is a file, not a folder
    """
    path = Path(path)
    if path.is_dir():
        raise SpecReplayError(f"cannot write {path}: it is a folder")
    folder, missing = path.parent if str(path.parent) else Path("."), None
    while not folder.exists() and folder != folder.parent:
        folder, missing = folder.parent, folder
    if not folder.is_dir():
        raise SpecReplayError(f"cannot write {path}: {folder} is a file, not a folder")
    try:
        if missing is not None:  # made and removed: write_atomic makes it when it writes
            missing.mkdir()
            missing.rmdir()
        else:
            fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        what = f"the folder {missing} cannot be made" if missing is not None else \
            f"{folder} takes no new file"
        raise SpecReplayError(f"cannot write {path}: {what} ({e.strerror or e})") from e


def write_atomic(path: Path | str, data: str | bytes, *, force: bool = False) -> Path:
    """Write `data` to `path` so that readers see either nothing or the whole file.

    The data goes to a temporary file in the same directory, is fsynced, then
    linked into place. Without `force` the link fails if `path` exists (no
    check-then-write race); with `force` it replaces `path` in one rename.
    """
    path = Path(path)
    refuse_existing(path, force)
    if path.is_symlink():
        path = path.resolve()  # replace the file the link points to, keep the link
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return _write(path, directory, data, force)
    except OSError as e:
        if isinstance(e, FileExistsError) and path.exists():
            raise OutputExistsError(f"{path} exists; use --force to overwrite it") from e
        raise SpecReplayError(f"cannot write {path}: {e.strerror or e}") from e


def _write(path: Path, directory: Path, data: str | bytes, force: bool) -> Path:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=directory)
    try:
        # mkstemp makes 0600 files: give the result the mode a plain open() would (or keep the old one)
        umask = os.umask(0)
        os.umask(umask)
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise OutputExistsError(f"{path} exists; use --force to overwrite it") from None
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_text_file(path: Path | str) -> str:
    """A user's text file (requests, transcripts), or one clear TranscriptError."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TranscriptError(f"cannot read: {e.strerror if isinstance(e, OSError) else e}", source=str(path)) from e


def read_request(path: Path | str) -> dict:
    """A request body from a JSON file (`--request`), or one clear TranscriptError."""
    text = read_text_file(path)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TranscriptError(f"invalid JSON ({json_error(e)})", source=str(path)) from e
    if not isinstance(obj, dict):
        raise TranscriptError("the request must be a JSON object", source=str(path))
    return obj
