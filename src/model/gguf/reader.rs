//! The GGUF container (little-endian, versions 2 and 3): header, metadata, tensor directory and
//! data section, memory-mapped. Every count and length is checked against the bytes left in the
//! file before anything is allocated, so a hostile file yields an error, never a panic or a
//! giant allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;

use super::metadata::{Array, Metadata, Value};
use super::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Deeper nesting has no use, and unbounded recursion on a crafted file would overflow the stack.
const MAX_ARRAY_DEPTH: usize = 8;
/// Smallest encodings, used to bound counts before allocating: key length + type + a u8 value;
/// name length + n_dims + type + offset.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;

/// One entry of the tensor directory, checked against the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: innermost (contiguous) dimension first, so a `[rows, cols]` matrix is
    /// `[cols, rows]` here.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub start: usize,
    pub n_elements: usize,
    pub n_bytes: usize,
}

/// An open GGUF file.
pub struct GgufFile {
    source: String,
    mmap: Mmap,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let source = path.display().to_string();
        let file = File::open(path).with_context(|| format!("{source}: cannot open"))?;
        let len = file
            .metadata()
            .with_context(|| format!("{source}: cannot stat"))?
            .len();
        if len < MAGIC.len() as u64 {
            bail!("{source}: not a GGUF file (only {len} bytes, too short for the magic)");
        }
        // SAFETY: the map is read-only. As with every mmap-based loader, another process
        // truncating or rewriting the file while it is mapped would break the slices we hand
        // out; we accept that for model files rather than copy 100s of MB into memory.
        let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("{source}: cannot map"))?;
        Parser {
            source: &source,
            c: Cursor { buf: &mmap, pos: 0 },
        }
        .parse()
        .map(|p| Self {
            source: source.clone(),
            version: p.version,
            metadata: p.metadata,
            index: p
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: p.tensors,
            alignment: p.alignment,
            data_start: p.data_start,
            mmap,
        })
    }

    /// The file as messages name it.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Tensors in directory order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (ranges were checked when the file was opened).
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        let t = self.tensor(name)?;
        Some(&self.mmap[t.start..t.start + t.n_bytes])
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute offset of the data section; tensor offsets in the file are relative to it.
    pub fn data_start(&self) -> usize {
        self.data_start
    }
}

/// Low-level parse errors are plain descriptions; the parser prefixes the file and the key or
/// tensor they concern.
type Parse<T> = std::result::Result<T, String>;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> Parse<&'a [u8]> {
        match usize::try_from(n).ok().filter(|&n| n <= self.left()) {
            Some(n) => {
                let bytes = &self.buf[self.pos..self.pos + n];
                self.pos += n;
                Ok(bytes)
            }
            None => Err(format!(
                "{what} ({n} bytes at offset {}) runs past the end of the file at {} bytes \
                 (truncated?)",
                self.pos,
                self.buf.len()
            )),
        }
    }

    fn fixed<const N: usize>(&mut self, what: &str) -> Parse<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Parse<u32> {
        self.fixed(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Parse<u64> {
        self.fixed(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Parse<String> {
        let len = self.u64(&format!("{what} length"))?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| format!("{what} at offset {start} is not valid UTF-8"))
    }

    /// `count` fixed-size little-endian numbers; the caller has bounded `count` by the bytes left.
    fn numbers<T, const N: usize>(
        &mut self,
        count: usize,
        decode: fn([u8; N]) -> T,
    ) -> Parse<Vec<T>> {
        let bytes = self.take((count * N) as u64, "array data")?;
        Ok(bytes
            .chunks_exact(N)
            .map(|b| {
                let mut a = [0u8; N];
                a.copy_from_slice(b);
                decode(a)
            })
            .collect())
    }
}

fn value_type_name(ty: u32) -> Option<&'static str> {
    Some(match ty {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        8 => "string",
        9 => "array",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => return None,
    })
}

/// Bytes the smallest value of a type takes in the file.
fn min_value_bytes(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        // A string is at least its u64 length.
        8 | 10..=12 => 8,
        // A nested array is at least its element type and length.
        _ => 12,
    }
}

fn read_value(c: &mut Cursor, ty: u32, depth: usize) -> Parse<Value> {
    Ok(match ty {
        0 => Value::U8(u8::from_le_bytes(c.fixed("u8 value")?)),
        1 => Value::I8(i8::from_le_bytes(c.fixed("i8 value")?)),
        2 => Value::U16(u16::from_le_bytes(c.fixed("u16 value")?)),
        3 => Value::I16(i16::from_le_bytes(c.fixed("i16 value")?)),
        4 => Value::U32(c.u32("u32 value")?),
        5 => Value::I32(i32::from_le_bytes(c.fixed("i32 value")?)),
        6 => Value::F32(f32::from_le_bytes(c.fixed("f32 value")?)),
        7 => Value::Bool(c.fixed::<1>("bool value")?[0] != 0),
        8 => Value::String(c.string("string")?),
        9 => Value::Array(read_array(c, depth)?),
        10 => Value::U64(c.u64("u64 value")?),
        11 => Value::I64(i64::from_le_bytes(c.fixed("i64 value")?)),
        12 => Value::F64(f64::from_le_bytes(c.fixed("f64 value")?)),
        other => return Err(format!("unknown value type {other}")),
    })
}

fn read_array(c: &mut Cursor, depth: usize) -> Parse<Array> {
    let elem = c.u32("array element type")?;
    let count = c.u64("array length")?;
    let name = value_type_name(elem).ok_or_else(|| format!("unknown array element type {elem}"))?;
    let fits = c.left() / min_value_bytes(elem);
    let n = match usize::try_from(count) {
        Ok(n) if n <= fits => n,
        _ => {
            return Err(format!(
                "array of {count} {name} elements at offset {} cannot fit in the {} bytes left \
                 (corrupt or truncated?)",
                c.pos,
                c.left()
            ))
        }
    };
    Ok(match elem {
        0 => Array::U8(c.numbers(n, u8::from_le_bytes)?),
        1 => Array::I8(c.numbers(n, i8::from_le_bytes)?),
        2 => Array::U16(c.numbers(n, u16::from_le_bytes)?),
        3 => Array::I16(c.numbers(n, i16::from_le_bytes)?),
        4 => Array::U32(c.numbers(n, u32::from_le_bytes)?),
        5 => Array::I32(c.numbers(n, i32::from_le_bytes)?),
        6 => Array::F32(c.numbers(n, f32::from_le_bytes)?),
        7 => Array::Bool(c.numbers(n, |[b]: [u8; 1]| b != 0)?),
        8 => Array::String(
            (0..n)
                .map(|i| c.string("string").map_err(|e| format!("element {i}: {e}")))
                .collect::<Parse<_>>()?,
        ),
        9 => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"));
            }
            Array::Array(
                (0..n)
                    .map(|i| read_array(c, depth + 1).map_err(|e| format!("element {i}: {e}")))
                    .collect::<Parse<_>>()?,
            )
        }
        10 => Array::U64(c.numbers(n, u64::from_le_bytes)?),
        11 => Array::I64(c.numbers(n, i64::from_le_bytes)?),
        _ => Array::F64(c.numbers(n, f64::from_le_bytes)?),
    })
}

struct Parsed {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: usize,
    data_start: usize,
}

/// A directory entry before the data section's position is known.
struct RawTensor {
    info: TensorInfo,
    offset: u64,
}

struct Parser<'a> {
    source: &'a str,
    c: Cursor<'a>,
}

impl Parser<'_> {
    fn parse(mut self) -> Result<Parsed> {
        let version = self.header()?;
        let n_tensors = self.header_count("tensor count")?;
        let n_kv = self.header_count("metadata count")?;
        self.check_count(n_kv, "metadata entries", MIN_KV_BYTES)?;
        let metadata = self.metadata(n_kv)?;
        self.check_count(n_tensors, "tensors", MIN_TENSOR_INFO_BYTES)?;
        let raw = (0..n_tensors)
            .map(|i| self.tensor_info(i, n_tensors))
            .collect::<Result<Vec<_>>>()?;
        let alignment = self.alignment(&metadata)?;
        let data_start = self
            .c
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| anyhow!("{}: data section offset overflows", self.source))?;
        let mut seen = HashMap::new();
        let mut tensors = Vec::with_capacity(raw.len());
        for (i, RawTensor { mut info, offset }) in raw.into_iter().enumerate() {
            if let Some(first) = seen.insert(info.name.clone(), i) {
                bail!(
                    "{}: tensor '{}' appears twice in the directory (entries {first} and {i})",
                    self.source,
                    info.name
                );
            }
            info.start = self.place(&info, offset, alignment, data_start)?;
            tensors.push(info);
        }
        Ok(Parsed {
            version,
            metadata,
            tensors,
            alignment,
            data_start,
        })
    }

    fn header(&mut self) -> Result<u32> {
        let src = self.source;
        let magic = self.c.take(4, "magic").map_err(|e| anyhow!("{src}: {e}"))?;
        if magic != MAGIC {
            bail!(
                "{src}: not a GGUF file (bad magic {:?}, expected \"GGUF\")",
                String::from_utf8_lossy(magic)
            );
        }
        let version = self
            .c
            .u32("version")
            .map_err(|e| anyhow!("{src}: header: {e}"))?;
        match version {
            2 | 3 => Ok(version),
            v if matches!(v.swap_bytes(), 2 | 3) => {
                bail!("{src}: big-endian GGUF files are not supported")
            }
            1 => bail!("{src}: GGUF version 1 is not supported (only versions 2 and 3)"),
            v => bail!("{src}: unsupported GGUF version {v} (only versions 2 and 3)"),
        }
    }

    fn header_count(&mut self, what: &str) -> Result<u64> {
        self.c
            .u64(what)
            .map_err(|e| anyhow!("{}: header: {e}", self.source))
    }

    /// Bounds a count from the header by the bytes that could hold its entries, before anything
    /// is allocated for them.
    fn check_count(&self, n: u64, plural: &str, min_entry_bytes: usize) -> Result<()> {
        let max = (self.c.left() / min_entry_bytes) as u64;
        if n > max {
            bail!(
                "{}: header claims {n} {plural}, but the {} bytes left can hold at most {max} \
                 (corrupt or truncated?)",
                self.source,
                self.c.left()
            );
        }
        Ok(())
    }

    fn metadata(&mut self, n_kv: u64) -> Result<Metadata> {
        let src = self.source;
        let mut metadata = Metadata::new(src.to_string());
        for i in 0..n_kv {
            let key = self
                .c
                .string("key")
                .map_err(|e| anyhow!("{src}: metadata entry {i} of {n_kv}: {e}"))?;
            let value = self
                .c
                .u32("value type")
                .and_then(|ty| read_value(&mut self.c, ty, 0))
                .map_err(|e| anyhow!("{src}: metadata key '{key}': {e}"))?;
            metadata.insert(key, value)?;
        }
        Ok(metadata)
    }

    fn tensor_info(&mut self, i: u64, n: u64) -> Result<RawTensor> {
        let src = self.source;
        let name = self
            .c
            .string("name")
            .map_err(|e| anyhow!("{src}: tensor info {i} of {n}: {e}"))?;
        let fail = |e: String| anyhow!("{src}: tensor '{name}': {e}");
        let n_dims = self.c.u32("dimension count").map_err(fail)?;
        if n_dims > MAX_DIMS {
            bail!("{src}: tensor '{name}': {n_dims} dimensions (ggml allows at most {MAX_DIMS})");
        }
        let dims = (0..n_dims)
            .map(|_| self.c.u64("dimension"))
            .collect::<Parse<Vec<u64>>>()
            .map_err(fail)?;
        let type_id = self.c.u32("type").map_err(fail)?;
        let offset = self.c.u64("data offset").map_err(fail)?;
        let ty = GgmlType::from_id(type_id)
            .ok_or_else(|| anyhow!("{src}: tensor '{name}': unknown ggml type {type_id}"))?;

        // ggml sizes are int64: anything beyond i64::MAX is a negative size there.
        let dims: Vec<usize> = dims
            .iter()
            .map(|&d| {
                usize::try_from(d)
                    .ok()
                    .filter(|&d| d as u64 <= i64::MAX as u64)
            })
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow!("{src}: tensor '{name}': dimensions {dims:?} are too large"))?;
        let n_elements = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n as u64 <= i64::MAX as u64)
            .ok_or_else(|| {
                anyhow!("{src}: tensor '{name}': dimensions {dims:?} overflow the element count")
            })?;
        let row = dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(ty.block_size()) {
            bail!(
                "{src}: tensor '{name}': rows of {row} elements are not a whole number of \
                 {ty} blocks ({} elements)",
                ty.block_size()
            );
        }
        let n_bytes = (n_elements / ty.block_size())
            .checked_mul(ty.type_size())
            .ok_or_else(|| anyhow!("{src}: tensor '{name}': data size overflows"))?;
        Ok(RawTensor {
            info: TensorInfo {
                name,
                dims,
                ty,
                start: 0,
                n_elements,
                n_bytes,
            },
            offset,
        })
    }

    fn alignment(&self, metadata: &Metadata) -> Result<usize> {
        let a = metadata
            .opt_u64("general.alignment")?
            .unwrap_or(DEFAULT_ALIGNMENT);
        if a == 0 || !a.is_power_of_two() || a > u32::MAX as u64 {
            bail!(
                "{}: metadata key 'general.alignment': {a} is not a power of two that fits in u32",
                self.source
            );
        }
        Ok(a as usize)
    }

    /// Absolute start of a tensor's data, checked to lie inside the file.
    fn place(
        &self,
        t: &TensorInfo,
        offset: u64,
        alignment: usize,
        data_start: usize,
    ) -> Result<usize> {
        let (src, name) = (self.source, &t.name);
        if !offset.is_multiple_of(alignment as u64) {
            bail!(
                "{src}: tensor '{name}': data offset {offset} is not a multiple of the \
                 alignment {alignment}"
            );
        }
        let len = self.c.buf.len();
        let start = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(data_start));
        match start.and_then(|s| Some((s, s.checked_add(t.n_bytes)?))) {
            Some((start, end)) if end <= len => Ok(start),
            _ => bail!(
                "{src}: tensor '{name}': data extends past end of file ({} bytes at offset \
                 {offset} of the data section at {data_start}, file is {len} bytes; truncated?)",
                t.n_bytes
            ),
        }
    }
}
