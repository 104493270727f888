"""The seccomp filter every sandboxed program runs under (given to bwrap with --seccomp FD; bwrap loads it right before
it execs the interpreter, so it holds for the code and everything the code starts).

It closes what the namespaces leave open, nothing more:

- socket(AF_VSOCK, ...) and socketpair(AF_VSOCK, ...) fail with EAFNOSUPPORT: a network namespace does not isolate
  vsock, so on a VM (Firecracker, cloud VMs) a program could otherwise talk to the hypervisor's host side;
- io_uring_setup fails with EPERM: io_uring can create sockets (IORING_OP_SOCKET) without the socket system call,
  i.e. behind this filter's back;
- system calls of another ABI (i386 on x86_64, arm32 on aarch64) and x86_64's x32 calls kill the process: their
  system call numbers differ, so the checks above would not see them.

Everything else is allowed. The program is classic BPF, assembled here with struct (no libseccomp): x86_64 and aarch64;
on any other machine the sandbox refuses to run (SandboxUnavailable naming it) rather than run without the filter.
"""
from __future__ import annotations

import errno
import platform
import struct
import sys

from .isolation import SandboxUnavailable

# machine -> (AUDIT_ARCH_* of its native ABI, socket, socketpair); io_uring_setup is 425 on both
ARCHES = {"x86_64": (0xC000003E, 41, 53), "aarch64": (0xC00000B7, 198, 199)}
AF_VSOCK = 40
_IO_URING_SETUP = 425
_X32 = 0x40000000  # x86_64's x32 ABI: the system call number with this bit set
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ..., BPF_RET
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000  # SECCOMP_RET_*
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]


def program(machine: str | None = None) -> bytes:
    """The filter as bwrap reads it: an array of struct sock_filter {u16 code; u8 jt; u8 jf; u32 k} in native byte
    order. Jump offsets count instructions after the jump."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SandboxUnavailable(f"the sandbox's seccomp filter is written for {sorted(ARCHES)}, not {machine!r}; "
                                 "refusing to run code without it")
    arch, socket, socketpair = ARCHES[machine]
    family = _ARG0 + (0 if sys.byteorder == "little" else 4)  # the low 32 bits of args[0] (an int: the family)
    instructions = [
        (_LD_W_ABS, 0, 0, _ARCH),                   # 0: A = arch
        (_JEQ_K, 0, 10, arch),                      # 1: another ABI -> 12 (kill)
        (_LD_W_ABS, 0, 0, _NR),                     # 2: A = system call number
        (_JGE_K, 8, 0, _X32),                       # 3: x32 -> 12 (kill)
        (_JEQ_K, 6, 0, _IO_URING_SETUP),            # 4: io_uring_setup -> 11 (EPERM)
        (_JEQ_K, 1, 0, socket),                     # 5: socket -> 7
        (_JEQ_K, 0, 2, socketpair),                 # 6: socketpair -> 7, anything else -> 9 (allow)
        (_LD_W_ABS, 0, 0, family),                  # 7: A = address family
        (_JEQ_K, 1, 0, AF_VSOCK),                   # 8: AF_VSOCK -> 10 (EAFNOSUPPORT)
        (_RET_K, 0, 0, _ALLOW),                     # 9
        (_RET_K, 0, 0, _ERRNO | errno.EAFNOSUPPORT),  # 10
        (_RET_K, 0, 0, _ERRNO | errno.EPERM),       # 11
        (_RET_K, 0, 0, _KILL_PROCESS),              # 12
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in instructions)
