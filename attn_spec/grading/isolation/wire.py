"""The grader's wire format: a JSON header and raw tensor bytes. Nothing is ever unpickled.

Between the grader and a submission's process (a stream socket), one frame is

    4-byte big-endian header length | JSON header | raw bytes of each tensor, in order

The header's ``"tensors"`` lists one record per tensor: ``dtype`` (from :data:`WIRE_DTYPES`), ``shape``,
``strides`` and ``nbytes`` (the storage span the strides address, so transposed, sliced and expanded
inputs arrive as they were sent). Other header fields are plain JSON; a tensor inside them is written
``{"$t": index}``. Frames from a submission are untrusted: :meth:`Channel.recv` checks every field and
the sizes before reading a byte of data, and rebuilds each tensor as a fresh plain ``torch.Tensor``.

Small control messages (grader <-> zygote <-> monitor) are JSON datagrams on SOCK_SEQPACKET
sockets, which keep message boundaries and can carry file descriptors.
"""
from __future__ import annotations

import ctypes
import json
import math
import socket
import time

import torch

from attn_spec.checking.cases import DTYPES
from attn_spec.errors import AttnSpecError

# What the wire carries: the kit's floating dtypes, plus the integer and bool dtypes masks and outputs may have.
WIRE_DTYPES = {
    **DTYPES, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_ITEMSIZE = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in WIRE_DTYPES.values()}
MAX_HEADER = 1 << 20  # bytes of JSON in one frame
MAX_DIMS = 8
MAX_EXTENT = 1 << 40  # largest size, stride or element count of a tensor on the wire (a view may be larger than its bytes)
BROKEN = 70  # a child's exit status when the kit's own code fails in it (EX_SOFTWARE)


class ProtocolError(AttnSpecError):
    """The peer sent something that is not a valid frame (or a tensor the wire does not carry)."""


class PeerClosed(AttnSpecError):
    """The other end closed the connection (the process is gone, or closed its socket)."""


# ---------------------------------------------------------------- tensors


def _span(shape, strides) -> int:
    """Elements of storage a strided view addresses (0 for an empty tensor)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def span_view(t: torch.Tensor) -> torch.Tensor:
    """The 1-D contiguous view of the storage ``t`` addresses: what an in-place edit can change."""
    return t.as_strided((_span(t.shape, t.stride()),), (1,), t.storage_offset())


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of the storage span ``t`` addresses, read on the CPU."""
    if t.device.type != "cpu":  # a device pointer is no address to read from here
        t = t.cpu()
    n = _span(t.shape, t.stride())
    return ctypes.string_at(t.data_ptr(), n * t.element_size()) if n else b""


def encode_tensor(t: torch.Tensor) -> tuple[dict, bytes]:
    """(record, raw bytes) of a plain tensor, strides kept; it is read on the CPU."""
    if t.dtype not in _NAMES:
        raise ProtocolError(f"the wire carries no {t.dtype} tensors")
    device = str(t.device)
    t = t.detach().cpu()  # strides as the CPU copy has them: .cpu() makes some layouts dense
    data = raw_bytes(t)
    return {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "strides": list(t.stride()), "nbytes": len(data),
            "device": device}, data


def _int_list(value, what) -> list[int]:
    if (not isinstance(value, list) or len(value) > MAX_DIMS
            or not all(type(x) is int and 0 <= x <= MAX_EXTENT for x in value)):
        raise ProtocolError(f"{what} must be a list of at most {MAX_DIMS} integers from 0 to 2**40")
    return value


def check_record(record, devices) -> tuple[torch.dtype, list[int], list[int], int, str]:
    """Validate one tensor record from the peer; returns (dtype, shape, strides, nbytes, device)."""
    if not isinstance(record, dict):
        raise ProtocolError("a tensor record is not an object")
    dtype = WIRE_DTYPES.get(record.get("dtype")) if isinstance(record.get("dtype"), str) else None
    if dtype is None:
        raise ProtocolError(f"dtype {str(record.get('dtype'))[:40]!r} is not one the wire carries "
                            f"({', '.join(WIRE_DTYPES)})")
    shape, strides = _int_list(record.get("shape"), "shape"), _int_list(record.get("strides"), "strides")
    nbytes, device = record.get("nbytes"), record.get("device")
    if len(strides) != len(shape) or type(nbytes) is not int or nbytes < 0:
        raise ProtocolError("shape, strides and nbytes disagree")
    if math.prod(shape) > MAX_EXTENT:  # a stride-0 view of a few bytes may claim any shape
        raise ProtocolError(f"a tensor of shape {shape} has more than 2**40 elements")
    if nbytes != _span(shape, strides) * _ITEMSIZE[dtype]:
        raise ProtocolError(f"nbytes={nbytes} but shape {shape} with strides {strides} needs "
                            f"{_span(shape, strides) * _ITEMSIZE[dtype]}")
    if not isinstance(device, str) or device.split(":")[0] not in devices:
        raise ProtocolError(f"device {str(device)[:40]!r} is not one of {', '.join(devices)}")
    return dtype, shape, strides, nbytes, device


def decode_tensor(checked: tuple, data: bytearray) -> torch.Tensor:
    """A fresh plain tensor from a record :func:`check_record` accepted, and its bytes."""
    dtype, shape, strides, _, device = checked
    base = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    out = base.as_strided(shape, strides, 0)
    return out if device == "cpu" else out.to(device)


# ---------------------------------------------------------------- values with tensors inside


def pack(value, tensors: list):
    """JSON-able form of ``value``; tensors are appended to ``tensors`` and replaced by {"$t": i}."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$t": len(tensors) - 1}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [pack(x, tensors) for x in value]
    if isinstance(value, dict):
        return {str(k): pack(v, tensors) for k, v in value.items()}
    raise ProtocolError(f"the wire carries no {type(value).__name__}")


def unpack(value, tensors: list):
    """Inverse of :func:`pack` (for trusted frames: the grader's requests)."""
    if isinstance(value, dict):
        if set(value) == {"$t"}:
            return tensors[value["$t"]]
        return {k: unpack(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [unpack(x, tensors) for x in value]
    return value


# ---------------------------------------------------------------- frames on a stream socket


def _settimeout(sock, deadline):
    if deadline is None:
        sock.settimeout(None)
    else:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)


class Channel:
    """Frames over a stream socket: one write per frame, buffered reads, a deadline on every syscall."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, bytearray()

    def close(self) -> None:
        self.sock.close()

    def send(self, header: dict, tensors=(), deadline: float | None = None) -> None:
        records, blobs = [], []
        for t in tensors:
            record, data = encode_tensor(t)
            records.append(record)
            blobs.append(data)
        head = json.dumps(dict(header, tensors=records)).encode()
        _settimeout(self.sock, deadline)  # sendall's timeout bounds the whole write
        self.sock.sendall(b"".join([len(head).to_bytes(4, "big"), head, *blobs]))

    def _take(self, n: int, deadline) -> bytearray:
        while len(self.buf) < n:
            _settimeout(self.sock, deadline)
            chunk = self.sock.recv(max(n - len(self.buf), 1 << 16))
            if not chunk:
                raise PeerClosed("the connection closed mid-frame" if self.buf else "the connection closed")
            self.buf += chunk
        data = self.buf[:n]
        del self.buf[:n]
        return data

    def recv(self, deadline: float | None = None, *, max_bytes: int = 1 << 30,
             devices=("cpu",)) -> tuple[dict, list[torch.Tensor]]:
        """One frame: (header, tensors). Raises TimeoutError, PeerClosed or ProtocolError."""
        size = int.from_bytes(self._take(4, deadline), "big")
        if size > MAX_HEADER:
            raise ProtocolError(f"a {size}-byte header (the limit is {MAX_HEADER})")
        try:
            header = json.loads(bytes(self._take(size, deadline)))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"the header is not JSON ({type(exc).__name__})") from None
        records = header.get("tensors") if isinstance(header, dict) else None
        if not isinstance(records, list):
            raise ProtocolError("the header is not an object with a list of tensors")
        checked = [check_record(r, devices) for r in records]
        if sum(c[3] for c in checked) > max_bytes:
            raise ProtocolError(f"the frame carries more than {max_bytes} bytes of tensors")
        tensors = []
        for c in checked:
            data = self._take(c[3], deadline)
            try:
                tensors.append(decode_tensor(c, data))
            except (RuntimeError, TypeError, ValueError, OverflowError) as exc:  # a record torch will not build
                raise ProtocolError(f"a tensor record cannot be rebuilt ({type(exc).__name__}: {str(exc)[:200]})") from None
        return header, tensors


# ---------------------------------------------------------------- control datagrams


def send_message(sock: socket.socket, message: dict, fds=()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_message(sock: socket.socket, maxfds: int = 0, timeout: float | None = None):
    """(message, fds) from a SEQPACKET socket; (None, []) when the peer has closed it."""
    sock.settimeout(timeout)
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, maxfds) if maxfds else (sock.recv(1 << 16), [], 0, None)
    if not data:
        return None, fds
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ProtocolError("a control message is not an object")
    return message, fds

