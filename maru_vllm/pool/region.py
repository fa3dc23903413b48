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

A new service either **recovers** the region left at its path (a warm restart: `recover`; the
file, its region UUID and every byte stay, the header gets a new incarnation and says the
service is running) or creates a *new* one. A new file is a new inode (unlink + O_EXCL
create), so a client still mapping the previous incarnation keeps seeing the previous
(immutable) contents instead of bytes being rewritten under it. It only ever replaces a file
that starts with the region magic (a region left behind); anything else at the path is
refused unless `force` (``--force``), so a mistyped --path cannot delete someone's file.

A region is recovered only when it is this pool's, of the same size, layout (`layout.Layout`:
presence table, catalog, heap) and catalog format, owned by this user and held by no running
service; the header records whether its last service stopped cleanly (`PreviousRun`).

Size: the region's backends (shm, DAX, file), its header and its recovery checks are one on-disk
format; keeping them together keeps the header's fields and their checks side by side.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from maru_vllm.pool.catalog import RECORD_FORMAT
from maru_vllm.pool.errors import PoolError
from maru_vllm.pool.layout import HEADER_SIZE, PAGE_SIZE, Layout, round_up

logger = logging.getLogger(__name__)

REGION_MAGIC = b"MARUPOOL"
LAYOUT_VERSION = 1
SHM_DIR = Path("/dev/shm")
DAX_SYSFS = Path("/sys/bus/dax/devices")
DEFAULT_DAX_ALIGN = 2 * 1024 * 1024
MIN_REGION_SIZE = 1024 * 1024

# magic, layout version, header size, region size, data offset, region uuid, incarnation,
# created (ns since epoch), pool name
_HEADER = struct.Struct("<8sIIQQ16s16sQ64s")
# What a warm restart needs, at EXT_AT (clients do not read it): magic, catalog format, state,
# presence buckets, catalog slots, heap offset, oid floor (no oid at or above it was handed out),
# started and stopped (ns since epoch; stopped 0 while running)
EXT_AT = 256
_EXT = struct.Struct("<8sIIQQQQQQ")
_EXT_MAGIC = b"MARUCATL"
_STATE_AT = EXT_AT + 12
_OID_FLOOR_AT = EXT_AT + 40
_STOPPED_AT = EXT_AT + 56
STATE_RUNNING = 1
STATE_STOPPED = 2  # the last service stopped cleanly
_INCARNATION_AT = 48  # the incarnation's 16 bytes in _HEADER
Recover = Literal["never", "auto", "require"]
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


@dataclass(frozen=True)
class PreviousRun:
    """What a recovered region's header said about the service that used it last."""

    region_uuid: str
    clean: bool  # it stopped cleanly (else it was killed, or crashed)
    oid_floor: int  # no oid at or above it was handed out
    started_ns: int
    stopped_ns: int


class Region:
    """A mapped region. `create` is the service side, `attach` is the client side."""

    def __init__(self, fd: int, mm: mmap.mmap, info: RegionInfo, owner: bool) -> None:
        self._fd = fd
        self.mm = mm
        self.info = info
        self.owner = owner
        self.view = memoryview(mm)
        self.layout: Layout | None = None  # the service's side
        self.previous: PreviousRun | None = None  # set when the region was recovered

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
        layout: Callable[[int], Layout] | None = None,
        recover: Recover = "never",
    ) -> Region:
        """The service's region: the one left at the path when `recover` allows and it is
        recoverable (`previous` is then set), else a new one. `layout(size)` lays out a region of
        the final size (default: no presence table, no catalog). `recover`: "never", "auto"
        (recover when possible, else start a new region and log why), "require" (raise when the
        region cannot be recovered)."""
        validate_pool_name(name)
        p = resolve_region_path(backend, name, path)
        mode = 0o660 if group is not None else 0o600
        previous: PreviousRun | None = None
        if backend == "dax":
            dev_size, align = dax_geometry(p, sysfs)
            size = round_up(size, align)
            if size > dev_size:
                raise RegionError(f"requested size {size} exceeds DAX device {p} size {dev_size}")
            lay = layout(size) if layout is not None else Layout(size, 0, 0)
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
            lay = layout(size) if layout is not None else Layout(size, 0, 0)
            found = _reopen(p, name, lay, recover) if recover != "never" else None
            if found is not None:
                fd, previous = found
            else:
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
            os.fchmod(fd, mode)
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            if backend != "dax" and previous is None:
                p.unlink(missing_ok=True)
            raise RegionError(f"cannot map region {p} ({size} bytes): {exc}") from exc
        if backend == "dax" and recover != "never":  # a device-DAX node is only mapped, never read
            try:
                previous = _previous_run(bytes(mm[: EXT_AT + _EXT.size]), p, name, lay, recover)
            except RegionError:
                mm.close()
                os.close(fd)
                raise
        info = RegionInfo(
            path=str(p),
            size=size,
            data_offset=HEADER_SIZE,
            region_uuid=previous.region_uuid if previous is not None else uuid.uuid4().hex,
            incarnation=uuid.uuid4().hex,
            pool=name,
            backend=backend,
        )
        region = cls(fd, mm, info, owner=True)
        region.layout = lay
        region.previous = previous
        region._write_header(previous.oid_floor if previous is not None else 0)
        logger.info(
            "%s region %s (%s, %d bytes, incarnation %s)",
            "recovered" if previous is not None else "created",
            p,
            backend,
            size,
            info.incarnation,
        )
        return region

    def _write_header(self, oid_floor: int) -> None:
        i = self.info
        lay = self.layout or Layout(i.size, 0, 0)
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
        self.mm[0:8] = bytes(8)  # no magic while the header changes: it never verifies half-written
        self.mm[: _HEADER.size] = packed
        self.mm[EXT_AT : EXT_AT + _EXT.size] = _EXT.pack(
            _EXT_MAGIC,
            RECORD_FORMAT,
            STATE_RUNNING,
            lay.presence_buckets,
            lay.catalog_slots,
            lay.heap_offset,
            oid_floor,
            time.time_ns(),
            0,
        )
        self.mm[0:8] = REGION_MAGIC  # last, so a half-written header never verifies

    def set_oid_floor(self, floor: int) -> None:
        """Record that no oid at or above `floor` has been handed out (the service's)."""
        struct.pack_into("<Q", self.mm, _OID_FLOOR_AT, floor)

    def mark_stopped(self) -> None:
        """Record a clean stop in the header (the service's, last thing before it unmaps)."""
        struct.pack_into("<Q", self.mm, _STOPPED_AT, time.time_ns())
        struct.pack_into("<I", self.mm, _STATE_AT, STATE_STOPPED)

    def serves_incarnation(self) -> bool:
        """Whether the header still names the incarnation this mapping was made for (a client:
        False once another service took the region over)."""
        return bytes(self.mm[_INCARNATION_AT : _INCARNATION_AT + 16]).hex() == self.info.incarnation

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
        """Unmap; exported memoryviews still alive keep the mapping (the GC closes it later).
        The service's region that stays (not `unlink`, or a DAX device) is marked stopped cleanly."""
        removed = unlink and self.owner and self.info.backend != "dax"
        if self.owner and not removed:
            self.mark_stopped()
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            logger.debug("region %s still has views in use; leaving the mapping to the GC", self.info.path)
        try:
            os.close(self._fd)
        except OSError:
            pass
        if removed:
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


def _recoverable(head: bytes, path: Path, name: str, lay: Layout) -> PreviousRun | str:
    """What the header `head` of the region at `path` says of its last run, or why a service
    laid out as `lay` must not recover it."""
    if len(head) < EXT_AT + _EXT.size or head[:8] != REGION_MAGIC:
        return "it is not a maru pool region (no MARUPOOL header)"
    _magic, version, hsize, size, _data, ruuid, _inc, _created, pool = _HEADER.unpack_from(head, 0)
    if version != LAYOUT_VERSION or hsize != HEADER_SIZE:
        return f"its layout version is {version}; this pool service writes version {LAYOUT_VERSION}"
    found = pool.rstrip(b"\0").decode(errors="replace")
    if found != name:
        return f"it belongs to pool {found!r}, not {name!r}"
    if size != lay.size:
        return f"it is {size} bytes and this start asks for {lay.size} (--size)"
    ext, fmt, state, buckets, slots, heap, oid_floor, started, stopped = _EXT.unpack_from(head, EXT_AT)
    if ext != _EXT_MAGIC:
        return "it has no object catalog (it was made by an older pool service)"
    if fmt != RECORD_FORMAT:
        return f"its object catalog has format {fmt}; this pool service reads format {RECORD_FORMAT}"
    if buckets != lay.presence_buckets:
        return (
            f"its presence table has {buckets} buckets and this start asks for {lay.presence_buckets}"
            " (--presence-buckets)"
        )
    if slots != lay.catalog_slots or heap != lay.heap_offset:
        return (
            f"its catalog has {slots} slots (heap at {heap}) and this start asks for {lay.catalog_slots} "
            f"(heap at {lay.heap_offset}; the catalog is sized from --size and --max-objects)"
        )
    return PreviousRun(ruuid.hex(), state == STATE_STOPPED, oid_floor, started, stopped)


def _previous_run(head: bytes, p: Path, name: str, lay: Layout, recover: Recover) -> PreviousRun | None:
    """The last run of the region whose header is `head` when it may be recovered; None (logged)
    when not and `recover` is "auto"; RegionError when not and it is "require"."""
    found = _recoverable(head, p, name, lay)
    if isinstance(found, PreviousRun):
        return found
    if recover == "require":
        raise RegionError(f"cannot recover region {p}: {found}")
    logger.info("not recovering region %s: %s; starting an empty one", p, found)
    return None


def _reopen(p: Path, name: str, lay: Layout, recover: Recover) -> tuple[int, PreviousRun] | None:
    """The region file left at `p`, open and locked, with its last run, when it may be recovered."""
    try:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        if recover == "require":
            raise RegionError(f"cannot recover region {p}: there is no region there") from None
        return None
    except OSError as exc:
        raise RegionError(f"cannot open existing region {p}: {exc}") from exc
    _lock(fd, p)  # raises (and closes fd) if another service holds it
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode) or os.pread(fd, len(REGION_MAGIC), 0) != REGION_MAGIC:
        os.close(fd)  # not a region at all: creating a new one replaces it or says why not
        if recover == "require":
            raise RegionError(f"cannot recover region {p}: it is not a maru pool region (no MARUPOOL header)")
        return None
    if st.st_uid != os.geteuid():
        why = f"it is owned by uid {st.st_uid}, not by this service's uid {os.geteuid()}"
    elif st.st_size != lay.size:
        why = f"the file is {st.st_size} bytes and this start asks for {lay.size} (--size)"
    previous = None
    if why is None:
        try:
            previous = _previous_run(os.pread(fd, EXT_AT + _EXT.size, 0), p, name, lay, recover)
        except RegionError:
            os.close(fd)
            raise
    elif recover == "require":
        os.close(fd)
        raise RegionError(f"cannot recover region {p}: {why}")
    else:
        logger.info("not recovering region %s: %s; starting an empty one", p, why)
    if previous is None:
        os.close(fd)  # _create_fresh replaces it (or refuses to)
        return None
    return fd, previous


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
