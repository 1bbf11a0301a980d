"""The C header and the NumPy view of the ring ABI are one definition: same sizes, offsets and
constants, proven by compiling the header with the host C compiler."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dpu_offload import abi

HEADER = Path(abi.__file__).parent / "include" / "ring.cuh"
STRUCTS = {
    "dpu_ring_header": abi.HEADER_DTYPE,
    "dpu_descriptor": abi.DESCRIPTOR_DTYPE,
    "dpu_completion": abi.COMPLETION_DTYPE,
    "dpu_region": abi.REGION_DTYPE,
    "dpu_packet_header": abi.PACKET_HEADER_DTYPE,
    "dpu_request": abi.REQUEST_DTYPE,
    "dpu_reply": abi.REPLY_DTYPE,
    "dpu_slot_state": abi.SLOT_STATE_DTYPE,
    "dpu_pin": abi.PIN_DTYPE,
    "dpu_slot_check": abi.CHECK_DTYPE,
}


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    lines = ['#include <stdio.h>', '#include <stddef.h>', f'#include "{HEADER}"',
             "int main(void) {"]
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("{struct}.__size__ %zu\\n", sizeof({struct}));')
        for field in dtype.names:
            lines.append(f'printf("{struct}.{field} %zu\\n", offsetof({struct}, {field}));')
            lines.append(f'printf("{struct}.{field}.__size__ %zu\\n", '
                         f'sizeof((({struct}*)0)->{field}));')
    lines += ["return 0;", "}"]
    tmp = tmp_path_factory.mktemp("abi")
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text("\n".join(lines))
    subprocess.run([cc, "-std=c11", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("struct", list(STRUCTS))
def test_struct_layout_matches(c_layout: dict[str, int], struct: str) -> None:
    dtype = STRUCTS[struct]
    assert c_layout[f"{struct}.__size__"] == dtype.itemsize
    for field in dtype.names:
        fdtype, offset = dtype.fields[field][:2]
        assert c_layout[f"{struct}.{field}"] == offset, field
        assert c_layout[f"{struct}.{field}.__size__"] == fdtype.itemsize, field


def _c_defines() -> dict[str, int]:
    text = HEADER.read_text()
    return {m[1]: int(m[2].rstrip("u"), 0)
            for m in re.finditer(r"#define (DPU_[A-Z0-9_]+) (0x[0-9a-fA-F]+u?|\d+u?)\b", text)}


def test_constants_match() -> None:
    c = _c_defines()
    assert c["DPU_RING_MAGIC"] == abi.RING_MAGIC
    assert c["DPU_ABI_VERSION"] == abi.ABI_VERSION
    assert c["DPU_HEADER_BYTES"] == abi.HEADER_BYTES
    assert c["DPU_COPY_ALIGN_BYTES"] == abi.COPY_ALIGN_BYTES
    assert c["DPU_MAX_REGIONS"] == abi.MAX_REGIONS
    assert c["DPU_SLOT_OFFSET_BITS"] == abi.SLOT_OFFSET_BITS
    for prefix, enum in (("RING", abi.RingKind), ("OP", abi.Opcode), ("STATUS", abi.Status),
                         ("REQ", abi.RequestOp), ("SLOT", abi.SlotState),
                         ("REQSTATUS", abi.RequestStatus)):
        for member in enum:
            assert c[f"DPU_{prefix}_{member.name}"] == member, (prefix, member)
    assert c["DPU_DESC_VERIFY"] == abi.DescriptorFlags.VERIFY
    assert c["DPU_REPLY_RESIDENT"] == abi.ReplyFlags.RESIDENT
    assert c["DPU_REPLY_PIN_HELD"] == abi.ReplyFlags.PIN_HELD
    for member in abi.RequestFlags:
        assert c[f"DPU_REQFLAG_{member.name}"] == member
    assert c["DPU_REGION_READABLE"] == abi.RegionFlags.READABLE
    assert c["DPU_REGION_WRITABLE"] == abi.RegionFlags.WRITABLE
    for member in abi.PacketFlags:
        assert c[f"DPU_PACKET_{member.name}"] == member
    assert c["DPU_MAX_CHANNEL_SLOTS"] == abi.MAX_CHANNEL_SLOTS
    assert c["DPU_MAX_ROUTE_COUNT"] == abi.MAX_ROUTE_COUNT
    assert c["DPU_SLOT_STATE_BITS"] == abi.SLOT_STATE_BITS



@pytest.mark.parametrize("dtype", [abi.REQUEST_DTYPE, abi.REPLY_DTYPE, abi.DESCRIPTOR_DTYPE,
                                   abi.COMPLETION_DTYPE, abi.SLOT_STATE_DTYPE,
                                   abi.HEADER_DTYPE, abi.PACKET_HEADER_DTYPE])
def test_packer_writes_the_bytes_numpy_does(dtype: np.dtype) -> None:
    """abi.packer (the fast writers' struct) lays every field where the dtype says."""
    rng = np.random.default_rng(int(dtype.itemsize))
    fields = sorted(dtype.fields.items(), key=lambda f: f[1][1])
    for _ in range(20):
        record = np.zeros(1, dtype)
        values = []
        for name, (ftype, _) in fields:
            if ftype.kind == "S":
                value = bytes(rng.integers(1, 256, rng.integers(0, ftype.itemsize + 1),
                                           dtype=np.uint8))
            else:
                value = int(rng.integers(0, 2 ** (8 * ftype.itemsize - 1)))
            record[name] = value
            values.append(value)
        assert abi.packer(dtype).pack(*values) == record.tobytes()
