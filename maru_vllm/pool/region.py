"""The shared memory region: backends, mapping and the region header.

One region per pool, mapped MAP_SHARED by the service and every client. The region starts
with a fixed header (magic, layout version, size, region UUID, service incarnation) so a client
verifies it mapped the region it was told about and never uses a stale or foreign one.

Backends:
  * ``shm``  - a file under /dev/shm (the default; any Linux box).
  * ``dax``  - a DAX character device (/dev/daxX.Y); mapped at the device alignment read from
               sysfs, never truncated or unlinked.
  * ``file`` - a file on a DAX-enabled filesystem or a hugetlbfs mount; the size is rounded up
               to the filesystem block size (the huge page size on hugetlbfs).

The service always creates a *new* file (unlink + O_EXCL create) rather than reusing an old
one in place, so a client still mapping the previous incarnation keeps seeing the previous
(immutable) contents instead of bytes being rewritten under it. It only ever replaces a file
that starts with the region magic (a region left behind); anything else at the path is
refused unless `force` (``--force``), so a mistyped --path cannot delete someone's file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from maru_vllm.pool.errors import PoolError

logger = logging.getLogger(__name__)

REGION_MAGIC = b"MARUPOOL"
LAYOUT_VERSION = 1
HEADER_SIZE = 4096  # the data area starts here; page aligned
PAGE_SIZE = 4096
SHM_DIR = Path("/dev/shm")
DAX_SYSFS = Path("/sys/bus/dax/devices")
DEFAULT_DAX_ALIGN = 2 * 1024 * 1024
MIN_REGION_SIZE = 1024 * 1024

# magic, layout version, header size, region size, data offset, region uuid, incarnation,
# created (ns since epoch), pool name
_HEADER = struct.Struct("<8sIIQQ16s16sQ64s")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
BACKENDS = ("shm", "dax", "file")


class RegionError(PoolError):
    """The region could not be created, mapped or verified."""


@dataclass(frozen=True)
class RegionInfo:
    """What the header says; the service hands these values to clients at hello."""

    path: str
    size: int
    data_offset: int
    region_uuid: str
    incarnation: str
    pool: str
    backend: str


def validate_pool_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise RegionError(
            f"invalid pool name {name!r}: use 1-63 characters from letters, digits, '.', '_', '-'"
            " (starting with a letter or digit)"
        )
    return name


def default_region_path(backend: str, name: str) -> Path:
    if backend == "shm":
        return SHM_DIR / f"maru-{name}"
    raise RegionError(f"backend {backend!r} needs --path (a DAX device or a file on a mount)")


def resolve_region_path(backend: str, name: str, path: str | None) -> Path:
    """Validate where the region lives; for shm it must stay inside /dev/shm."""
    if backend not in BACKENDS:
        raise RegionError(f"invalid backend {backend!r}: allowed are {', '.join(BACKENDS)}")
    if path is None:
        return default_region_path(backend, name)
    p = Path(path)
    if backend == "shm":
        if not p.is_absolute():
            p = SHM_DIR / p
        resolved = Path(os.path.normpath(p))
        if resolved.parent != SHM_DIR or resolved.name in ("", ".", ".."):
            raise RegionError(f"invalid shm path {path!r}: it must name a file directly inside {SHM_DIR}")
        return resolved
    if not p.is_absolute():
        raise RegionError(f"invalid {backend} path {path!r}: it must be absolute")
    if backend == "dax" and not re.match(r"^dax\d+\.\d+$", p.name):
        raise RegionError(f"invalid dax path {path!r}: expected a device like /dev/dax0.0")
    return p


def parse_size(text: str | int, minimum: int = MIN_REGION_SIZE) -> int:
    """'4G', '512M', '64k', '1.5G' or plain bytes -> bytes (binary multiples), at least `minimum`."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text or "")
        if not m:
            raise ValueError(
                f"invalid size {text!r}: use bytes or a number with a K, M, G or T suffix (e.g. 536870912, 512M, 4G)"
            )
        mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
        value = int(float(m.group(1)) * mult)
    if value < minimum:
        if minimum == MIN_REGION_SIZE:
            raise ValueError(f"invalid size {text!r}: the pool needs at least 1M ({MIN_REGION_SIZE} bytes)")
        raise ValueError(f"invalid size {text!r}: use at least {minimum} bytes")
    return value


def dax_geometry(device: Path, sysfs: Path = DAX_SYSFS) -> tuple[int, int]:
    """(size, alignment) of a device-DAX node, from sysfs."""
    base = sysfs / device.name
    try:
        size = int((base / "size").read_text().strip())
    except (OSError, ValueError) as exc:
        raise RegionError(f"cannot read the size of DAX device {device} from {base}/size: {exc}") from exc
    align = DEFAULT_DAX_ALIGN
    try:
        align = int((base / "align").read_text().strip())
    except (OSError, ValueError):
        logger.debug("no %s/align; assuming %d", base, DEFAULT_DAX_ALIGN)
    return size, align


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class Region:
    """A mapped region. `create` is the service side, `attach` is the client side."""

    def __init__(self, fd: int, mm: mmap.mmap, info: RegionInfo, owner: bool) -> None:
        self._fd = fd
        self.mm = mm
        self.info = info
        self.owner = owner
        self.view = memoryview(mm)

    @property
    def size(self) -> int:
        return self.info.size

    @classmethod
    def create(
        cls,
        name: str,
        size: int,
        *,
        backend: str = "shm",
        path: str | None = None,
        group: int | None = None,
        sysfs: Path = DAX_SYSFS,
        force: bool = False,
    ) -> Region:
        validate_pool_name(name)
        p = resolve_region_path(backend, name, path)
        mode = 0o660 if group is not None else 0o600
        if backend == "dax":
            dev_size, align = dax_geometry(p, sysfs)
            size = round_up(size, align)
            if size > dev_size:
                raise RegionError(f"requested size {size} exceeds DAX device {p} size {dev_size}")
            try:
                fd = os.open(p, os.O_RDWR)
            except OSError as exc:
                raise RegionError(f"cannot open DAX device {p}: {exc}") from exc
            if not stat.S_ISCHR(os.fstat(fd).st_mode):
                os.close(fd)
                raise RegionError(f"{p} is not a character device (use --backend file for a file)")
            _lock(fd, p)
        else:
            if not p.parent.is_dir():
                raise RegionError(f"directory {p.parent} for the region does not exist")
            if backend == "file":
                size = round_up(size, max(PAGE_SIZE, os.statvfs(p.parent).f_bsize))
            else:
                size = round_up(size, PAGE_SIZE)
            fd = _create_fresh(p, mode, force)
            try:
                os.ftruncate(fd, size)
                _reserve_space(fd, size, p)
            except (OSError, RegionError) as exc:
                os.close(fd)
                p.unlink(missing_ok=True)
                if isinstance(exc, RegionError):
                    raise
                raise RegionError(f"cannot size region {p} to {size} bytes: {exc}") from exc
        if group is not None and backend != "dax":
            os.fchown(fd, -1, group)
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            if backend != "dax":
                p.unlink(missing_ok=True)
            raise RegionError(f"cannot map region {p} ({size} bytes): {exc}") from exc
        info = RegionInfo(
            path=str(p),
            size=size,
            data_offset=HEADER_SIZE,
            region_uuid=uuid.uuid4().hex,
            incarnation=uuid.uuid4().hex,
            pool=name,
            backend=backend,
        )
        region = cls(fd, mm, info, owner=True)
        region._write_header()
        logger.info("created region %s (%s, %d bytes, incarnation %s)", p, backend, size, info.incarnation)
        return region

    def _write_header(self) -> None:
        i = self.info
        packed = _HEADER.pack(
            b"\0" * 8,
            LAYOUT_VERSION,
            HEADER_SIZE,
            i.size,
            i.data_offset,
            bytes.fromhex(i.region_uuid),
            bytes.fromhex(i.incarnation),
            time.time_ns(),
            i.pool.encode()[:64],
        )
        self.mm[: _HEADER.size] = packed
        self.mm[0:8] = REGION_MAGIC  # last, so a half-written header never verifies

    @classmethod
    def attach(
        cls,
        path: str,
        *,
        size: int,
        region_uuid: str,
        incarnation: str,
        backend: str = "shm",
        populate: bool = True,
    ) -> Region:
        """Map an existing region and verify its header matches what the service announced.

        `populate` pre-faults the page tables (MAP_POPULATE) so the first write or read of each
        page does not take a fault on the data path."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise RegionError(f"cannot open region {path}: {exc}") from exc
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise RegionError(f"cannot map region {path} ({size} bytes): {exc}") from exc
        try:
            info = read_header(mm, path, backend)
            expected = (size, region_uuid, incarnation)
            found = (info.size, info.region_uuid, info.incarnation)
            if found != expected:
                raise RegionError(
                    f"region {path} is not the one the service announced: "
                    f"expected size/uuid/incarnation {expected}, found {found}"
                )
        except RegionError:
            mm.close()
            os.close(fd)
            raise
        return cls(fd, mm, info, owner=False)

    def close(self, *, unlink: bool = False) -> None:
        """Unmap; exported memoryviews still alive keep the mapping (the GC closes it later)."""
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            logger.debug("region %s still has views in use; leaving the mapping to the GC", self.info.path)
        try:
            os.close(self._fd)
        except OSError:
            pass
        if unlink and self.owner and self.info.backend != "dax":
            try:
                os.unlink(self.info.path)
            except FileNotFoundError:
                pass


def read_header(mm: mmap.mmap | memoryview, path: str = "?", backend: str = "shm") -> RegionInfo:
    if len(mm) < _HEADER.size:
        raise RegionError(f"region {path} is too small to hold a header")
    magic, version, hsize, size, data_offset, ruuid, inc, _created, name = _HEADER.unpack_from(mm, 0)
    if magic != REGION_MAGIC:
        raise RegionError(f"region {path} has no maru pool header (magic {magic!r})")
    if version != LAYOUT_VERSION or hsize != HEADER_SIZE:
        raise RegionError(f"region {path} has layout version {version}; this client supports {LAYOUT_VERSION}")
    return RegionInfo(
        path=path,
        size=size,
        data_offset=data_offset,
        region_uuid=ruuid.hex(),
        incarnation=inc.hex(),
        pool=name.rstrip(b"\0").decode(errors="replace"),
        backend=backend,
    )


def _reserve_space(fd: int, size: int, p: Path) -> None:
    """Allocate the backing pages now: a full /dev/shm then fails here, at start, instead of
    killing a writer with SIGBUS later (tmpfs allocates lazily)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise RegionError(f"not enough space for a {size}-byte region at {p} ({exc.strerror})") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        logger.debug("fallocate not supported for %s; pages are allocated on first touch", p)


def _lock(fd: int, p: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise RegionError(f"region {p} is in use by another running pool service") from exc


def _create_fresh(p: Path, mode: int, force: bool = False) -> int:
    """Replace an old region file with a new inode, refusing if a live service holds it or
    (unless `force`) if the file is not a Maru region."""
    try:
        old = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        old = -1
    except OSError as exc:
        raise RegionError(f"cannot open existing region {p}: {exc}") from exc
    if old >= 0:
        _lock(old, p)  # raises if another service holds it
        if not stat.S_ISREG(os.fstat(old).st_mode):
            os.close(old)
            raise RegionError(f"{p} exists and is not a regular file; refusing to replace it")
        if os.pread(old, len(REGION_MAGIC), 0) != REGION_MAGIC and not force:
            os.close(old)
            raise RegionError(
                f"{p} exists and is not a maru pool region (no {REGION_MAGIC.decode()} header); refusing to "
                "replace it: remove it yourself or pass --force"
            )
        os.unlink(p)
        os.close(old)
        logger.info("replaced stale region file %s", p)
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise RegionError(f"cannot create region {p}: {exc}") from exc
    os.fchmod(fd, mode)  # umask-proof
    _lock(fd, p)
    return fd
