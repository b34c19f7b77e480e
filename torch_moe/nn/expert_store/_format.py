"""The safetensors file format, written and read with the standard library.

A safetensors file is ``u64 little-endian N | N bytes of JSON header | data``. The header maps
each tensor name to ``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` (byte
offsets into the data, which the tensors cover without holes, in order) and may hold a
``"__metadata__"`` object of string values. The header may end in spaces; we pad it so that the
data starts on a page boundary, so that an expert's bytes start page-aligned in the mapping when
their sizes are multiples of the page (``madvise`` / ``posix_fadvise`` work on pages).

Reading maps the file (``mmap``) and views each tensor with ``torch.frombuffer``: nothing is read
until a tensor's bytes are touched, which is what makes the file a tier of an expert store.
"""

import ctypes
import json
import mmap
import os
import struct
import sys
import weakref
from typing import Optional

import torch
from torch import Tensor

__all__ = ["write_safetensors", "SafetensorsFile", "DTYPES"]

# safetensors' dtype names
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_PAGE = mmap.PAGESIZE
# madvise(2) advice that faults a range in for reading (Linux 5.14); Python names it from 3.13 on
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else -1)
# madvise(2) through ctypes rather than mmap.madvise, which holds the GIL for the whole call: a
# MADV_POPULATE_READ that waits for the disk would stop the compute thread with it (a ctypes
# call releases the GIL)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000  # Linux's values; mmap names neither
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14 if sys.platform == "linux" else -1)


def _madvise(address: int, length: int, advice: int) -> None:
    if _libc.madvise(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


# a header larger than this is not a safetensors header (the format's own limit is 100 MB)
_MAX_HEADER = 100_000_000


def _pmd_size() -> int:
    """What one page-middle-directory entry maps (a transparent huge page): 2 MiB on x86-64
    and on arm64 with 4 KiB pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def _thp_enabled() -> bool:
    """Whether transparent huge pages are on (``always`` or ``madvise``): the kernel accepts
    ``MADV_HUGEPAGE`` even when they are ``never``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _kernel_version() -> tuple:
    try:
        return tuple(int(p) for p in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return (0, 0)


def _file_system(fd: int) -> Optional[str]:
    """The type of the file system holding the open file ``fd``, from ``/proc/self/mountinfo``
    (the mount whose device is the file's)."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == dev and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


# file systems whose page cache holds large folios for regular files, from the kernel release
# that added them (a file system left out keeps single-page folios as far as this code knows)
_LARGE_FOLIOS = {"xfs": (5, 18), "ext4": (6, 16)}


def _large_folio_page_cache(fd: int) -> bool:
    """Whether a fault in a ``MADV_HUGEPAGE`` mapping of ``fd`` reads PMD-sized folios:
    transparent huge pages on, and a file system that keeps large folios in its page cache."""
    since = _LARGE_FOLIOS.get(_file_system(fd) or "")
    return since is not None and _kernel_version() >= since and _thp_enabled()


def _map_off_pmd(fd: int, length: int, pmd: int) -> int:
    """Maps the file private (copy-on-write) at an address one page past a multiple of
    ``pmd``, and returns that address.

    The kernel maps a large page-cache folio with a single PMD entry wherever the mapping's
    address and the file offset agree modulo ``pmd``, as its own choice of address makes them
    do. Such an entry spans the neighbours of an expert (whose bytes need not start on a PMD
    boundary in the file); unmapping any part of it unmaps all of it, and mapping one expert
    would map its neighbours. One page off, every page is mapped by its own entry: what a
    cache slot maps is exactly its expert's pages, whatever the folios' sizes."""
    span = length + 2 * pmd
    base = _libc.mmap(None, span, 0,  # PROT_NONE: an address range reserved, nothing mapped
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    address = -(-base // pmd) * pmd + _PAGE
    got = _libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
    if got != address:
        err = ctypes.get_errno()
        if got not in (None, _MAP_FAILED):  # mapped, but elsewhere: not what was asked
            _libc.munmap(got, length)
            err = 0
        _libc.munmap(base, span)
        raise OSError(err, f"mmap at {address:#x}: {os.strerror(err) if err else 'moved'}")
    # what the reservation holds around the file's mapping goes back
    _libc.munmap(base, address - base)
    _libc.munmap(address + length, base + span - address - length)
    return address


class _FileMapping:
    """A whole file mapped private (copy-on-write: no write reaches the file), as a buffer for
    ``torch.frombuffer`` (``buffer``) at ``address``.

    On Linux the mapping is made one page off the PMD alignment (:func:`_map_off_pmd`) and, with
    ``huge_pages`` where the page cache can hold large folios (:func:`_large_folio_page_cache`),
    advised ``MADV_HUGEPAGE``: a page fault then reads the file into the page cache in
    PMD-sized folios, rather than in single pages as ``POSIX_FADV_WILLNEED`` or a read that
    looks random does. ``huge_pages`` says whether that is so. Mapping 1.5 MiB experts
    in and out of a page cache of large folios took 0.5-0.65 s of kernel time per decode run of
    the offload benchmark, against 1.4-1.6 s out of single pages. Elsewhere, or if that fails,
    ``mmap.mmap``.

    The mapping is unmapped once :meth:`close` has been called and the last view of it is gone
    (the views hold ``buffer``)."""

    def __init__(self, fd: int, size: int, huge_pages: bool):
        self._mm = None
        self.address = None
        length = -(-size // _PAGE) * _PAGE
        if sys.platform == "linux":
            try:
                self.address = _map_off_pmd(fd, length, _pmd_size())
            except OSError:
                pass
        if self.address is not None:
            self.buffer = (ctypes.c_char * size).from_address(self.address)
            # not at exit: a daemon thread may still read a view then
            weakref.finalize(self.buffer, _libc.munmap, self.address, length).atexit = False
        else:
            # the kernel's address: PMD-mappable, so no huge pages (see _map_off_pmd)
            self._mm = self.buffer = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            self.address = torch.frombuffer(self._mm, dtype=torch.uint8, count=1).data_ptr()
        self.huge_pages = False
        if huge_pages and self._mm is None and _large_folio_page_cache(fd):
            try:
                _madvise(self.address, length, _MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError:  # a kernel built without transparent huge pages
                pass

    def close(self) -> None:
        # Drops this reference only. Views hold the buffer (torch.frombuffer keeps its object):
        # the mapping goes with the last of them (mmap.close() would unmap it under them, as
        # the views have released their buffer exports).
        self._mm = self.buffer = None


def write_safetensors(path, tensors: dict, metadata: Optional[dict] = None) -> None:
    """Writes ``tensors`` (name -> CPU-copyable tensor, in the order given) to ``path``.

    The data is written through a writable mapping of the file, tensor by tensor, so that no
    copy of all the tensors is ever held in memory."""
    header, offset = {}, 0
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"write_safetensors: expected {name!r} to be a tensor, but got "
                            f"{type(t).__name__}")
        if t.dtype not in _NAMES:
            raise TypeError(f"write_safetensors: {name!r} has dtype {t.dtype}, which safetensors "
                            f"cannot store (one of {sorted(str(d) for d in _NAMES)})")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError("write_safetensors: metadata keys and values must be str, but got "
                                f"{k!r}: {type(v).__name__}")
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _PAGE)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(start + offset)
    if offset == 0:
        return
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), start + offset) as mm:
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=offset)
        for name, t in tensors.items():
            b, e = header[name]["data_offsets"]
            if e > b:
                src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                data[b:e].copy_(src)
        del data, src
        mm.flush()


class SafetensorsFile:
    """A safetensors file mapped read-only (copy-on-write, so no write can reach the file).

    ``get(name)`` is a zero-copy view of the mapping; ``byte_range(name)`` its place in the file,
    for :meth:`release` (drop the pages from this process's mapping, and optionally from the
    page cache)."""

    def __init__(self, path, huge_pages: bool = False):
        self.path = os.fspath(path)
        self._huge_pages = huge_pages
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise FileNotFoundError(f"SafetensorsFile: cannot open {self.path!r}: {e}") from None
        try:
            self._read_header()
        except Exception:
            os.close(self._fd)
            raise

    def _fail(self, what: str):
        raise ValueError(f"SafetensorsFile: {self.path!r} is not a valid safetensors file: {what}")

    def _read_header(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < 8:
            self._fail(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > min(size - 8, _MAX_HEADER):
            self._fail(f"header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"header is not JSON ({e})")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + n
        data_size = size - self._start
        self._entries = {}
        end_seen = 0
        for name, entry in sorted(header.items(), key=lambda kv: _begin(kv[1])):
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                self._fail(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
            dtype = DTYPES.get(entry["dtype"])
            shape, offsets = entry["shape"], entry["data_offsets"]
            if dtype is None:
                self._fail(f"entry {name!r} has unknown dtype {entry['dtype']!r}")
            if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
                self._fail(f"entry {name!r} has shape {shape!r}, not a list of sizes")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
                self._fail(f"entry {name!r} has data_offsets {offsets!r}")
            b, e = offsets
            numel = 1
            for s in shape:
                numel *= s
            if e - b != numel * dtype.itemsize:
                self._fail(f"entry {name!r} holds {e - b} bytes, but {entry['dtype']} {shape} needs "
                           f"{numel * dtype.itemsize}")
            if b != end_seen or e > data_size:
                self._fail(f"entry {name!r} at bytes [{b}, {e}) overlaps another, leaves a hole or "
                           f"runs past the data ({data_size} bytes)")
            end_seen = e
            self._entries[name] = (dtype, tuple(shape), b, e)
        self._map = _FileMapping(self._fd, size, self._huge_pages) if size > 0 else None
        self._mm = self._map.buffer if self._map is not None else None
        # where the mapping starts, for madvise
        self._address = self._map.address if self._map is not None else None
        # whether page faults read the file in PMD-sized folios (see _FileMapping)
        self.huge_pages = self._map is not None and self._map.huge_pages
        self._buffers: dict = {}

    def keys(self):
        return self._entries.keys()

    def __contains__(self, name) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[torch.dtype, tuple]:
        """``(dtype, shape)`` of ``name``."""
        dtype, shape, _, _ = self._entry(name)
        return dtype, shape

    def _entry(self, name):
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"SafetensorsFile: {self.path!r} has no tensor {name!r}") from None

    def get(self, name: str) -> Tensor:
        """A view of ``name`` in the mapping (read lazily, page by page)."""
        dtype, shape, b, e = self._entry(name)
        if e == b:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=(e - b) // dtype.itemsize,
                                offset=self._start + b).view(shape)

    def byte_range(self, name: str) -> tuple[int, int]:
        """``(offset, length)`` of ``name``'s bytes in the file."""
        _, _, b, e = self._entry(name)
        return self._start + b, e - b

    def read_into(self, names: list, dst: list) -> int:
        """Reads tensors ``names`` into the contiguous CPU tensors ``dst`` (same dtypes and
        sizes) with ``os.preadv``: one system call for tensors adjacent in the file, which
        releases the GIL, touches no page of the mapping (no page faults, nothing added to the
        resident set but ``dst``) and starts no OpenMP team. Returns the bytes read."""
        total = 0
        i = 0
        while i < len(names):
            # a run of tensors adjacent in the file: one preadv
            start, _ = self.byte_range(names[i])
            end, bufs, j = start, [], i
            while j < len(names):
                off, n = self.byte_range(names[j])
                if off != end:
                    break
                bufs.append(self._buffer(dst[j], n, names[j]))
                end += n
                j += 1
            done = 0
            while done < end - start:
                got = os.preadv(self._fd, _skip(bufs, done), start + done)
                if got <= 0:
                    raise OSError(f"SafetensorsFile: {self.path!r} ended while reading "
                                  f"{names[i:j]} (file truncated?)")
                done += got
            total += done
            i = j
        return total

    def _buffer(self, t: Tensor, nbytes: int, name: str) -> memoryview:
        # cache slots are a fixed set of tensors: their buffers are made once (a ctypes
        # array per read would hold the GIL for longer than the read's bookkeeping)
        _check_destination(t, nbytes, name)
        key = (t.data_ptr(), nbytes)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = _writable_bytes(t, nbytes)
        return buf

    def release(self, offset: int, length: int, page_cache: bool = False) -> None:
        """Unmaps ``[offset, offset + length)`` from this process (its resident set shrinks; the
        pages stay in the page cache), and with ``page_cache`` drops them from the page cache too
        (``POSIX_FADV_DONTNEED``: the next read goes to the disk). In that order: the kernel does
        not drop pages that a process still maps."""
        mapping = self._mm  # alive for the call, whatever close() does meanwhile
        if length <= 0 or mapping is None:
            return
        lo = offset - offset % _PAGE
        _madvise(self._address + lo, offset + length - lo, mmap.MADV_DONTNEED)
        if page_cache:
            os.posix_fadvise(self._fd, lo, offset + length - lo, os.POSIX_FADV_DONTNEED)

    def populate(self, offset: int, length: int) -> None:
        """Maps ``[offset, offset + length)`` into this process, reading what the page cache
        lacks from the disk, and returns when it is resident (``MADV_POPULATE_READ``, Linux 5.14;
        elsewhere by reading a byte of every page)."""
        mapping = self._mm  # alive for the call, whatever close() does meanwhile
        if length <= 0 or mapping is None:
            return
        lo = offset - offset % _PAGE
        try:
            _madvise(self._address + lo, offset + length - lo, _MADV_POPULATE_READ)
        except OSError:
            touch = torch.frombuffer(mapping, dtype=torch.uint8, count=offset + length - lo,
                                     offset=lo)
            int(touch[::_PAGE].sum())

    def advise(self, offset: int, length: int) -> None:
        """Starts reading ``[offset, offset + length)`` into the page cache in the background
        (``POSIX_FADV_WILLNEED``), for a read that follows soon."""
        if length > 0:
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)

    def drop_page_cache(self) -> None:
        """Drops the whole file from this mapping and from the page cache (a cold start)."""
        mapping = self._mm
        if mapping is not None:
            _madvise(self._address, len(mapping), mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def mapping_address(self) -> Optional[int]:
        """Start address of the mapping (to find it in ``/proc/self/smaps``)."""
        return self._address

    def close(self) -> None:
        self._buffers = {}
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = self._mm = None
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None


def _check_destination(t: Tensor, nbytes: int, name: str) -> None:
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() != nbytes:
        raise ValueError(f"SafetensorsFile.read_into: {name!r} needs a contiguous CPU tensor of "
                         f"{nbytes} bytes, but got {t.device} {t.dtype} {tuple(t.shape)}")


def _writable_bytes(t: Tensor, nbytes: int) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` as a writable buffer (for ``preadv``)."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def _skip(bufs: list, n: int) -> list:
    """``bufs`` without their first ``n`` bytes (after a short read)."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _begin(entry) -> int:
    try:
        return int(entry["data_offsets"][0])
    except (TypeError, KeyError, IndexError, ValueError):
        return -1
