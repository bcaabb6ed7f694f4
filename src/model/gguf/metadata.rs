//! GGUF metadata values and typed access to them, with errors that name the file and key.

use std::collections::BTreeMap;
use std::fmt;

use anyhow::{anyhow, bail, Result};

/// One metadata value. Arrays are typed so that a hostile file cannot make the reader
/// allocate many times the file's size (a boxed value per `u8` element would).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
}

impl Value {
    /// The GGUF name of the value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Any integer type that holds a non-negative value: writers disagree on the width they use
    /// for counts and ids.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GGUF name of the element type, for messages.
    pub fn element_type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "u8",
            Array::I8(_) => "i8",
            Array::U16(_) => "u16",
            Array::I16(_) => "i16",
            Array::U32(_) => "u32",
            Array::I32(_) => "i32",
            Array::U64(_) => "u64",
            Array::I64(_) => "i64",
            Array::F32(_) => "f32",
            Array::F64(_) => "f64",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
        }
    }

    /// Elements as `i64`, for integer arrays of any width (token types are i32 by the spec,
    /// but nothing stops a writer from using another width).
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        fn widen<T: Copy + Into<i64>>(v: &[T]) -> Vec<i64> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            Array::U8(v) => widen(v),
            Array::I8(v) => widen(v),
            Array::U16(v) => widen(v),
            Array::I16(v) => widen(v),
            Array::U32(v) => widen(v),
            Array::I32(v) => widen(v),
            Array::I64(v) => v.clone(),
            Array::U64(v) => v
                .iter()
                .map(|&x| i64::try_from(x).ok())
                .collect::<Option<_>>()?,
            _ => return None,
        })
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(a) => write!(f, "[{} × {}]", a.len(), a.element_type_name()),
        }
    }
}

/// The key/value section of one file.
#[derive(Debug, Clone)]
pub struct Metadata {
    /// The file, as messages name it.
    source: String,
    entries: BTreeMap<String, Value>,
}

impl Metadata {
    pub(super) fn new(source: String) -> Self {
        Self {
            source,
            entries: BTreeMap::new(),
        }
    }

    /// Adds an entry; a key seen twice makes the file ambiguous, so it is refused.
    pub(super) fn insert(&mut self, key: String, value: Value) -> Result<()> {
        if self.entries.contains_key(&key) {
            bail!("{}: metadata key '{key}' appears twice", self.source);
        }
        self.entries.insert(key, value);
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &Value) -> anyhow::Error {
        anyhow!(
            "{}: metadata key '{key}': expected {expected}, found {} {found}",
            self.source,
            found.type_name()
        )
    }

    fn missing(&self, key: &str) -> anyhow::Error {
        anyhow!("{}: required metadata key '{key}' is missing", self.source)
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
            })
            .transpose()
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.opt_u64(key)?
            .map(|v| {
                usize::try_from(v)
                    .map_err(|_| anyhow!("{}: metadata key '{key}': {v} is too large", self.source))
            })
            .transpose()
    }

    pub fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    /// A token id; ids are `u32` everywhere downstream.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.opt_u64(key)?
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    anyhow!(
                        "{}: metadata key '{key}': {v} does not fit in u32",
                        self.source
                    )
                })
            })
            .transpose()
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| self.wrong_type(key, "a float", v))
            })
            .transpose()
    }

    pub fn req_f32(&self, key: &str) -> Result<f32> {
        self.opt_f32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.wrong_type(key, "a string", v))
            })
            .transpose()
    }

    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, "a bool", v)))
            .transpose()
    }

    pub fn opt_string_array(&self, key: &str) -> Result<Option<&[String]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::String(v))) => Ok(Some(v)),
            Some(Value::Array(a)) => bail!(
                "{}: metadata key '{key}': expected an array of strings, found an array of {}",
                self.source,
                a.element_type_name()
            ),
            Some(v) => Err(self.wrong_type(key, "an array of strings", v)),
        }
    }

    pub fn req_string_array(&self, key: &str) -> Result<&[String]> {
        self.opt_string_array(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let ints = v.as_array().and_then(Array::to_i64s);
        ints.map(Some)
            .ok_or_else(|| self.wrong_type(key, "an array of integers", v))
    }
}
