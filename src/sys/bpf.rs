//! eBPF: the instructions, an assembler with labels for the programs written here, and
//! every bpf(2) call (include/uapi/linux/bpf.h; the kernel's
//! Documentation/bpf/standardization/instruction-set.rst for the encoding).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// One eBPF instruction (the kernel's struct bpf_insn).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    code: u8,
    /// Destination register in the low four bits, source in the high four.
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | src << 4,
        off,
        imm,
    }
}

/// A register: R0 (results), R1–R5 (arguments, clobbered by calls and packet loads),
/// R6–R9 (kept across them), R10 (the frame pointer, read-only).
pub type Reg = u8;
pub const R0: Reg = 0;
pub const R1: Reg = 1;
pub const R2: Reg = 2;
pub const R3: Reg = 3;
pub const R4: Reg = 4;
pub const R6: Reg = 6;
pub const R7: Reg = 7;
pub const R8: Reg = 8;
pub const R9: Reg = 9;
pub const FP: Reg = 10;

// Instruction classes, sizes, modes and operations (bpf.h, bpf_common.h).
const LD: u8 = 0x00;
const LDX: u8 = 0x01;
const ST: u8 = 0x02;
const STX: u8 = 0x03;
const ALU: u8 = 0x04;
const JMP: u8 = 0x05;
const ALU64: u8 = 0x07;
const IMM: u8 = 0x00;
const IND: u8 = 0x40;
const MEM: u8 = 0x60;
const X: u8 = 0x08;
const END: u8 = 0xd0;
const CALL: u8 = 0x80;
const EXIT: u8 = 0x90;
const PSEUDO_MAP_FD: u8 = 1;

/// An access's width.
#[derive(Clone, Copy, Debug)]
pub enum Size {
    B = 0x10,
    H = 0x08,
    W = 0x00,
    DW = 0x18,
}

/// A 64-bit arithmetic operation.
#[derive(Clone, Copy, Debug)]
pub enum Alu {
    Add = 0x00,
    Sub = 0x10,
    Mul = 0x20,
    Or = 0x40,
    And = 0x50,
    Lsh = 0x60,
    Rsh = 0x70,
    Xor = 0xa0,
    Mov = 0xb0,
}

/// A jump's condition, on unsigned 64-bit values.
#[derive(Clone, Copy, Debug)]
pub enum Cond {
    Eq = 0x10,
    Gt = 0x20,
    Ge = 0x30,
    /// Any bit in common.
    Set = 0x40,
    Ne = 0x50,
    Lt = 0xa0,
    Le = 0xb0,
}

/// The second operand: a register, or a 32-bit immediate (sign-extended to 64 bits).
#[derive(Clone, Copy, Debug)]
pub enum Src {
    X(Reg),
    K(i32),
}

/// A place in a program being written, bound once to where it points.
#[derive(Clone, Copy, Debug)]
pub struct Label(usize);

/// Writes a program: instructions in order, jumps to labels resolved at the end.
#[derive(Debug, Default)]
pub struct Asm {
    code: Vec<Insn>,
    /// Per label, the instruction it points at, once bound.
    labels: Vec<Option<usize>>,
    /// Jumps to patch: the instruction and its label.
    jumps: Vec<(usize, Label)>,
}

impl Asm {
    pub fn label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }

    /// Points `l` at the next instruction written.
    pub fn bind(&mut self, l: Label) {
        assert!(self.labels[l.0].is_none(), "a label is bound once");
        self.labels[l.0] = Some(self.code.len());
    }

    fn push(&mut self, i: Insn) {
        self.code.push(i);
    }

    /// `dst = dst op src`, 64 bits wide.
    pub fn alu(&mut self, op: Alu, dst: Reg, src: Src) {
        match src {
            Src::X(r) => self.push(insn(ALU64 | op as u8 | X, dst, r, 0, 0)),
            Src::K(k) => self.push(insn(ALU64 | op as u8, dst, 0, 0, k)),
        }
    }

    pub fn mov(&mut self, dst: Reg, src: Src) {
        self.alu(Alu::Mov, dst, src);
    }

    /// `dst` = its low `bits` bits (16, 32 or 64) in network byte order, read as a number.
    pub fn from_be(&mut self, dst: Reg, bits: i32) {
        // BPF_ALU | BPF_END | BPF_TO_BE: a swap on a little-endian host, none on a big one.
        self.push(insn(ALU | END | X, dst, 0, 0, bits));
    }

    /// `dst = (u64) src` as a 64-bit constant (two instruction slots).
    pub fn imm64(&mut self, dst: Reg, v: u64) {
        self.push(insn(LD | IMM | Size::DW as u8, dst, 0, 0, v as u32 as i32));
        self.push(insn(0, 0, 0, 0, (v >> 32) as u32 as i32));
    }

    /// `dst` = the map whose descriptor is `fd` (two instruction slots).
    pub fn map(&mut self, dst: Reg, fd: BorrowedFd) {
        self.push(insn(
            LD | IMM | Size::DW as u8,
            dst,
            PSEUDO_MAP_FD,
            0,
            fd.as_raw_fd(),
        ));
        self.push(insn(0, 0, 0, 0, 0));
    }

    /// `R0` = the packet's bytes at `src + off` (from its network header on, as a socket
    /// filter sees them), in network byte order read as a number. A read past the
    /// packet's end ends the program, returning 0. Clobbers R1–R5; needs R6 = the context.
    pub fn load_packet(&mut self, size: Size, src: Reg, off: i32) {
        self.push(insn(LD | IND | size as u8, 0, src, 0, off));
    }

    /// `dst = *(size *)(src + off)`.
    pub fn load(&mut self, size: Size, dst: Reg, src: Reg, off: i16) {
        self.push(insn(LDX | MEM | size as u8, dst, src, off, 0));
    }

    /// `*(size *)(dst + off) = src`.
    pub fn store(&mut self, size: Size, dst: Reg, off: i16, src: Src) {
        match src {
            Src::X(r) => self.push(insn(STX | MEM | size as u8, dst, r, off, 0)),
            Src::K(k) => self.push(insn(ST | MEM | size as u8, dst, 0, off, k)),
        }
    }

    /// `if dst cond src goto to`.
    pub fn jump_if(&mut self, cond: Cond, dst: Reg, src: Src, to: Label) {
        self.jumps.push((self.code.len(), to));
        match src {
            Src::X(r) => self.push(insn(JMP | cond as u8 | X, dst, r, 0, 0)),
            Src::K(k) => self.push(insn(JMP | cond as u8, dst, 0, 0, k)),
        }
    }

    pub fn goto(&mut self, to: Label) {
        self.jumps.push((self.code.len(), to));
        self.push(insn(JMP, 0, 0, 0, 0));
    }

    /// Calls helper function number `helper` (enum bpf_func_id): arguments in R1–R5, the
    /// result in R0, R1–R5 clobbered.
    pub fn call(&mut self, helper: i32) {
        self.push(insn(JMP | CALL, 0, 0, 0, helper));
    }

    /// Returns R0.
    pub fn exit(&mut self) {
        self.push(insn(JMP | EXIT, 0, 0, 0, 0));
    }

    /// The program, its jumps resolved.
    ///
    /// # Panics
    ///
    /// If a label jumped to was never bound, or a jump is longer than an instruction's
    /// offset holds: mistakes of the program's writer.
    pub fn finish(mut self) -> Vec<Insn> {
        for &(at, to) in &self.jumps {
            let target = self.labels[to.0].expect("every label jumped to is bound");
            let off = target as isize - at as isize - 1;
            self.code[at].off = i16::try_from(off).expect("a jump within 32k instructions");
        }
        self.code
    }
}

/// Helper functions (enum bpf_func_id).
pub const MAP_LOOKUP_ELEM: i32 = 1;
pub const MAP_UPDATE_ELEM: i32 = 2;
pub const KTIME_GET_NS: i32 = 5;
pub const SKB_LOAD_BYTES: i32 = 26;
pub const REDIRECT_MAP: i32 = 51;

/// bpf(2) commands and constants used here.
const BPF_MAP_CREATE: i32 = 0;
const BPF_MAP_UPDATE_ELEM: i32 = 2;
const BPF_PROG_LOAD: i32 = 5;
const BPF_PROG_TEST_RUN: i32 = 10;
const BPF_LINK_CREATE: i32 = 28;

/// Map types (enum bpf_map_type).
#[derive(Clone, Copy, Debug)]
pub enum MapType {
    LruHash = 9,
    XskMap = 17,
}

/// Program types (enum bpf_prog_type), each with the attach type it is loaded for.
#[derive(Clone, Copy, Debug)]
pub enum ProgType {
    /// A socket filter, as a packet socket's fanout group runs to pick a member.
    SocketFilter,
    /// An XDP program, attached to an interface by a link.
    Xdp,
}

/// The attach type of XDP (enum bpf_attach_type).
const BPF_XDP: u32 = 37;

/// The leading fields of union bpf_attr that each command reads; the kernel takes a
/// shorter attribute than its own as zero beyond it.
#[repr(C)]
#[derive(Default)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

#[repr(C)]
#[derive(Default)]
struct MapUpdate {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
#[derive(Default)]
struct TestRun {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
}

#[repr(C)]
#[derive(Default)]
struct LinkCreate {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// bpf(2): `cmd` with attribute `attr`; the descriptor or value it returns.
fn bpf<T>(cmd: i32, attr: &mut T) -> io::Result<i32> {
    // SAFETY: `attr` is a live, initialised attribute of the size given, read (and for
    // some commands written) by the kernel during the call; the pointers inside it, if
    // any, point at memory alive for the call and as large as the attribute says.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            (attr as *mut T).cast::<libc::c_void>(),
            size_of::<T>() as u32,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as i32)
}

/// A descriptor bpf(2) returned, owned.
fn owned(fd: i32) -> OwnedFd {
    // SAFETY: a descriptor just returned to us and owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// An object's name as the kernel keeps it (15 bytes and a NUL at most).
fn name(s: &str) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[..s.len().min(15)].copy_from_slice(&s.as_bytes()[..s.len().min(15)]);
    n
}

/// Makes a map of `max_entries` entries of `key` and `value` bytes.
pub fn create_map(
    kind: MapType,
    key: u32,
    value: u32,
    max_entries: u32,
    label: &str,
) -> io::Result<OwnedFd> {
    bpf(
        BPF_MAP_CREATE,
        &mut MapCreate {
            map_type: kind as u32,
            key_size: key,
            value_size: value,
            max_entries,
            map_name: name(label),
            ..MapCreate::default()
        },
    )
    .map(owned)
}

/// Sets `map[key] = value` (both as the map's sizes say).
pub fn update_map<K, V>(map: BorrowedFd, key: &K, value: &V) -> io::Result<()> {
    bpf(
        BPF_MAP_UPDATE_ELEM,
        &mut MapUpdate {
            map_fd: map.as_raw_fd() as u32,
            key: (key as *const K) as u64,
            value: (value as *const V) as u64,
            ..MapUpdate::default()
        },
    )
    .map(drop)
}

/// Loads `code` as a program of type `kind`. A program the kernel's verifier refuses is
/// loaded again for the verifier's log, whose end the error carries.
pub fn load(kind: ProgType, code: &[Insn], label: &str) -> io::Result<OwnedFd> {
    // The programs written here call only helpers open to any licence.
    let license = c"Apache-2.0";
    let (prog_type, expected_attach_type) = match kind {
        ProgType::SocketFilter => (1, 0),
        ProgType::Xdp => (6, BPF_XDP),
    };
    let mut attr = ProgLoad {
        prog_type,
        insn_cnt: code.len() as u32,
        insns: code.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name(label),
        expected_attach_type,
        ..ProgLoad::default()
    };
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(owned(fd)),
        Err(e)
            if e.raw_os_error() == Some(libc::EACCES) || e.raw_os_error() == Some(libc::EINVAL) =>
        {
            let mut log = vec![0u8; 1 << 20];
            attr.log_level = 1;
            attr.log_size = log.len() as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
            let again = bpf(BPF_PROG_LOAD, &mut attr);
            if let Ok(fd) = again {
                return Ok(owned(fd));
            }
            let text = String::from_utf8_lossy(&log);
            let text = text.trim_end_matches('\0').trim_end();
            let tail: Vec<&str> = text.lines().rev().take(12).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(io::Error::new(
                e.kind(),
                format!("{e}; the verifier said: {}", tail.join(" / ")),
            ))
        }
        Err(e) => Err(e),
    }
}

/// Runs socket-filter program `program` once over frame `data` (an Ethernet frame: the
/// program sees it from its network header on, as on receive) and returns what it
/// returned (BPF_PROG_TEST_RUN).
pub fn test_run(program: BorrowedFd, data: &[u8]) -> io::Result<u32> {
    let mut attr = TestRun {
        prog_fd: program.as_raw_fd() as u32,
        data_size_in: data.len() as u32,
        data_in: data.as_ptr() as u64,
        repeat: 1,
        ..TestRun::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok(attr.retval)
}

/// Attaches XDP program `program` to interface `ifindex` by a link: the program stays
/// while the link's descriptor lives.
pub fn attach_xdp(program: BorrowedFd, ifindex: u32) -> io::Result<OwnedFd> {
    bpf(
        BPF_LINK_CREATE,
        &mut LinkCreate {
            prog_fd: program.as_raw_fd() as u32,
            target_ifindex: ifindex,
            attach_type: BPF_XDP,
            flags: 0,
        },
    )
    .map(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_count_from_the_next_instruction() {
        let mut a = Asm::default();
        let (back, ahead) = (a.label(), a.label());
        a.bind(back);
        a.mov(R0, Src::K(1));
        a.jump_if(Cond::Eq, R0, Src::K(1), ahead);
        a.goto(back);
        a.bind(ahead);
        a.exit();
        let code = a.finish();
        assert_eq!(code[1].off, 1, "over the goto");
        assert_eq!(code[2].off, -3, "back to the first");
        assert_eq!(code[1].code, 0x15, "BPF_JMP | BPF_JEQ | BPF_K");
        assert_eq!(code[2].code, 0x05, "BPF_JA");
    }
}
