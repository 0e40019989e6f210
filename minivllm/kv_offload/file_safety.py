"""The file tier's plumbing (chapter 13), not taught: what makes a folder of KV block files safe to keep on a disk
that other users and other engines share, as the cache directories of trusted tools are (pip's, ccache's).

- **Identity**: `model_fingerprint` names what computed the keys and values: a SHA-256 of the weights as loaded
  (so a checkpoint re-saved in place, another model under the same relative path, or an int8 copy of the same
  model is another identity), of the model's configuration, of the classes of its modules (chapter 8b's kernels
  and int8 layers are swapped-in classes) and of torch's version; `resolved_model_name` makes the path absolute
  and follows its links.
- **The folder**: `private_folder` creates the tier's folder with mode 0700 and refuses, with a message, a folder
  or any folder above it that another user owns or that others may write (unless, like /tmp, it is sticky).
- **Opening**: `read_regular_file` opens without following a link and without blocking (a FIFO), and reads only
  a regular file of exactly the expected size; `write_file` writes a fresh temporary (O_EXCL, O_NOFOLLOW, a
  random name, mode 0600) and renames it into place; `scan_folder` lists the blocks at start-up and removes
  whatever else bears a block's name.
- **Authentication**: `installation_key` is a 32-byte secret kept in the folder (mode 0600, made on first use);
  `mac` is the HMAC-SHA256 the tier puts on every block file and checks before it parses anything.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from pathlib import Path

import torch

KEY_NAME = ".minivllm-kv-key"
KEY_BYTES = 32
MAC_BYTES = 32
MAX_HEADER_BYTES = 64 << 10  # a header names the identity and one block hash: about 2 KB


def resolved_model_name(model_name) -> str:
    """A path that exists, made absolute with its links followed (the same folder from any working directory);
    a name that is not a path (a hub name) as given."""
    name = str(model_name)
    return os.path.realpath(name) if os.path.exists(name) else name


def model_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer as loaded (names, dtypes, shapes and bytes), the model's
    configuration, the classes of its modules, and torch's version."""
    digest = hashlib.sha256()
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    for name, tensor in sorted(tensors.items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    modules = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
    digest.update(repr((getattr(model, "config", None), modules, torch.__version__)).encode())
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> dict:
    """What about the model decides its keys and values, besides its name (the module docstring)."""
    return {"model_digest": model_digest(model)}


def refuse(path: Path, why: str) -> None:
    raise ValueError(f"KV file tier folder {path}: {why}; give kv_offloading_file_tier a root_dir of your own "
                     f"(a folder only you can write, such as one under your home folder)")


def check_folder(path: Path, info: os.stat_result, above: bool) -> None:
    """The tier's folder (above=False) must be this user's and writable by nobody else; a folder above it may
    also be root's, and may be writable by others if it is sticky (as /tmp): nobody else can rename it away."""
    owners = (os.geteuid(), 0) if above else (os.geteuid(),)
    if not stat.S_ISDIR(info.st_mode):
        refuse(path, "not a folder (a link, or a file)")
    if info.st_uid not in owners:
        refuse(path, f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")
    if info.st_mode & 0o022 and not (above and info.st_mode & stat.S_ISVTX):
        refuse(path, f"mode {stat.S_IMODE(info.st_mode):04o}: others may write to it")


def private_folder(root, name: str) -> Path:
    """root/name (`~` expanded), made with mode 0700 if new (root too), after checking root and every folder
    above it."""
    root = Path(os.path.realpath(os.path.abspath(os.path.expanduser(root))))
    os.makedirs(root, mode=0o700, exist_ok=True)
    for folder in [root, *root.parents]:
        check_folder(folder, os.stat(folder), above=True)
    folder = root / name
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    check_folder(folder, info, above=False)
    if stat.S_IMODE(info.st_mode) & 0o077:  # ours, readable by others (an older version made it so): no longer
        os.chmod(folder, 0o700)
    return folder


def read_regular_file(path: Path, size: int) -> bytes:
    """The bytes of a regular file of exactly `size` bytes; OSError or ValueError for anything else (a link, a
    FIFO, a device, a folder, another size), without following a link, blocking, or reading past `size`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size != size:
            raise ValueError(f"{info.st_size} bytes, {size} expected")
        chunks, left = [], size + 1  # one byte more: a file that grew since fstat is refused too
        while left:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) != size:
        raise ValueError(f"{len(data)} bytes read, {size} expected")
    return data


def write_new_file(folder: Path, stem: str, data: bytes) -> Path:
    """A new file in `folder` holding `data`, under a random temporary name, created exclusively (a name
    planted in advance, a link included, is never written through), mode 0600. Returns its path."""
    path = folder / f"{stem}.{secrets.token_hex(8)}.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def write_file(folder: Path, name: str, data: bytes) -> None:
    """folder/name holds `data`, or OSError: written to a new temporary (`write_new_file`), then renamed over
    the name, so that a reader never sees half a file (a link at the name is replaced, never followed)."""
    temporary = write_new_file(folder, name, data)
    try:
        os.replace(temporary, folder / name)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def scan_folder(folder: Path, size_of, suffix: str = ".kv") -> tuple[list[bytes], int]:
    """The block hashes of the folder's regular `<hex hash><suffix>` files of the size `size_of(hash)` gives,
    oldest first, and how many other entries of such names there were. Those (a link, a FIFO, a file of another
    size), and a temporary a crash left (a minute old: a younger one may be another engine's, being written),
    are removed: never read, never followed, and not there at the next start either."""
    found, refused = [], 0
    for entry in os.scandir(folder):
        stem, _, ending = entry.name.rpartition(".")
        if f".{ending}" not in (suffix, ".tmp"):
            continue
        info = entry.stat(follow_symlinks=False)
        try:
            block_hash = bytes.fromhex(stem) if f".{ending}" == suffix else None
        except ValueError:
            block_hash = None
        if block_hash is not None and stat.S_ISREG(info.st_mode) and info.st_size == size_of(block_hash):
            found.append((info.st_mtime_ns, entry.name, block_hash))
            continue
        refused += f".{ending}" == suffix
        if not stat.S_ISDIR(info.st_mode) and (ending != "tmp" or info.st_mtime < time.time() - 60):
            Path(entry.path).unlink(missing_ok=True)
    return [block_hash for _, _, block_hash in sorted(found)], refused


def installation_key(folder: Path) -> bytes:
    """The folder's secret: read if it is a 0600 regular file of this user's, of 32 bytes; otherwise (missing,
    damaged, a link, readable by others) replaced by a new one, which every existing block then fails."""
    path = folder / KEY_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            good = (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
                    and info.st_size == KEY_BYTES)
            key = os.read(fd, KEY_BYTES + 1) if good else b""
        finally:
            os.close(fd)
        if len(key) == KEY_BYTES:
            return key
    except FileNotFoundError:
        pass
    except OSError:  # a link (ELOOP), or unreadable
        pass
    key = secrets.token_bytes(KEY_BYTES)
    write_file(folder, KEY_NAME, key)  # replaces a link itself, never its target
    return key


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def mac_matches(key: bytes, data: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(mac(key, data), tag)
