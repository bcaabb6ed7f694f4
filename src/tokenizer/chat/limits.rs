//! The limits a chat template renders within, beyond minijinja's own fuel: the bytes it writes
//! (`MAX_TEMPLATE_OUTPUT_BYTES`), the length of any one string it builds
//! (`MAX_TEMPLATE_STRING_BYTES`), the items of any one list (`MAX_TEMPLATE_LIST_ITEMS`) and the
//! work done inside instructions (`MAX_TEMPLATE_WORK`). minijinja has no setting for any of
//! them, so the template's compiled code gets a check in front of each instruction that writes
//! text, joins or repeats strings or lists, or walks or compares them (`checked`), the
//! builtins that can lengthen a string, build a list or walk one are replaced by ones that
//! check first, and constants that minijinja would fold while compiling are checked before it
//! does.
//!
//! Fuel counts an instruction as one unit however much it copies, so the checks also count
//! the items and bytes each one copies, walks or compares against `MAX_TEMPLATE_WORK`
//! (`Budget::work`).
//! That count is only honest if walking a list costs about its length. minijinja keeps joins
//! (`+`, `chain`), repeats (`*`) and slices lazy, and a lazy list built from other lazy lists
//! can cost far more to walk than its length shows (a one-item slice that skips a million
//! items first; a list grown one item at a time, each item passing through up to 32 nested
//! joins). So the checks copy a lazy list into a plain one, counting the copy, before `+` or
//! `*` builds on it, and slices and `chain` are collected when they are made: every lazy list a
//! template holds is then one level over plain lists, and walks in about its length.

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use minijinja::machinery::{Instruction, Instructions};
use minijinja::value::{Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, Value};

use super::{
    MAX_TEMPLATE_LIST_ITEMS, MAX_TEMPLATE_OUTPUT_BYTES, MAX_TEMPLATE_STRING_BYTES,
    MAX_TEMPLATE_WORK,
};

/// The most an escaped byte grows by when a template turns on auto-escaping: HTML writes `'`
/// as `&#x27;`, JSON a control byte as `\u0000`.
const MAX_ESCAPE_GROWTH: usize = 6;

/// What one render has used of its limits. The checks in the render's environment share it;
/// `render` reads it afterwards to name the limit that stopped the template, whatever error
/// minijinja made of the check's failure on the way out.
#[derive(Default)]
pub(super) struct Budget {
    /// Bytes written so far, to the output and into collected text.
    written: AtomicUsize,
    output_exceeded: AtomicBool,
    string_exceeded: AtomicBool,
    list_exceeded: AtomicBool,
    /// Work done so far, in `MAX_TEMPLATE_WORK`'s units.
    work: AtomicUsize,
    work_exceeded: AtomicBool,
}

/// Bytes of a string copied or scanned that count as one unit of work. A unit is one item of
/// a list copied or walked (50 to 130 ns on 2 shared cores); strings are copied or searched at
/// 0.2 to 2 ns a byte, so 64 bytes take about as long.
const BYTES_PER_WORK: usize = 64;
/// Bytes of a string taken apart character by character (slicing, reversing, escaping into
/// JSON: 2.5 to 10 ns a byte) that count as one unit. Changing case costs 18 to 48 ns a byte
/// (Unicode tables, and `title` looks at the character before), so there a byte is a unit.
const CHARS_PER_WORK: usize = 8;

/// Ok when `n` is within `limit`; otherwise raises `flag` (so `render` names the limit) and
/// fails with an error that names it.
fn within(
    flag: &AtomicBool,
    n: usize,
    limit: usize,
    what: &str,
    unit: &str,
    name: &str,
) -> Result<(), Error> {
    if n <= limit {
        return Ok(());
    }
    flag.store(true, Relaxed);
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{what} of {n} {unit} or more passes the limit of {limit} {unit} ({name})"),
    ))
}

impl Budget {
    pub(super) fn output_exceeded(&self) -> bool {
        self.output_exceeded.load(Relaxed)
    }

    pub(super) fn string_exceeded(&self) -> bool {
        self.string_exceeded.load(Relaxed)
    }

    /// Fails if a string of `len` bytes is more than one may hold.
    pub(super) fn string(&self, len: usize) -> Result<(), Error> {
        within(
            &self.string_exceeded,
            len,
            MAX_TEMPLATE_STRING_BYTES,
            "a string",
            "bytes",
            "MAX_TEMPLATE_STRING_BYTES",
        )
    }

    pub(super) fn list_exceeded(&self) -> bool {
        self.list_exceeded.load(Relaxed)
    }

    /// Fails if a list of `items` items is more than one may hold.
    fn list(&self, items: usize) -> Result<(), Error> {
        within(
            &self.list_exceeded,
            items,
            MAX_TEMPLATE_LIST_ITEMS,
            "a list",
            "items",
            "MAX_TEMPLATE_LIST_ITEMS",
        )
    }

    pub(super) fn work_exceeded(&self) -> bool {
        self.work_exceeded.load(Relaxed)
    }

    /// Counts `units` more work, failing past `MAX_TEMPLATE_WORK`.
    pub(super) fn work(&self, units: usize) -> Result<(), Error> {
        let total = self.work.load(Relaxed).saturating_add(units);
        self.work.store(total, Relaxed);
        within(
            &self.work_exceeded,
            total,
            MAX_TEMPLATE_WORK,
            "work (items and bytes copied, walked or compared)",
            "units",
            "MAX_TEMPLATE_WORK",
        )
    }

    /// Work done so far.
    pub(super) fn work_done(&self) -> usize {
        self.work.load(Relaxed)
    }

    /// Counts walking or copying `items` items; an empty list still costs a step.
    pub(super) fn walk(&self, items: usize) -> Result<(), Error> {
        self.work(items.saturating_add(1))
    }

    /// Counts copying or scanning `bytes` bytes of strings.
    pub(super) fn bytes(&self, bytes: usize) -> Result<(), Error> {
        self.work(1 + bytes / BYTES_PER_WORK)
    }

    /// Counts taking apart `bytes` bytes of strings character by character.
    pub(super) fn chars(&self, bytes: usize) -> Result<(), Error> {
        self.work(1 + bytes / CHARS_PER_WORK)
    }

    /// Counts making `len` bytes of text of `v`: a string is copied, any other value is
    /// formatted piece by piece (a list of small numbers at about 30 ns a byte), which is
    /// counted as an item a byte.
    fn text(&self, v: &Value, len: usize) -> Result<(), Error> {
        if v.kind() == ValueKind::String {
            self.bytes(len)
        } else {
            self.work(len.saturating_add(1))
        }
    }

    /// Counts walking `v` once: its items, or a string's bytes.
    fn walk_value(&self, v: &Value) -> Result<(), Error> {
        match v.kind() {
            ValueKind::String => self.bytes(v.as_str().map_or(0, str::len)),
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
                self.walk(v.len().unwrap_or(0))
            }
            _ => self.work(1),
        }
    }

    /// Work left before the limit, plus one: as far as a count of work needs to go.
    fn left(&self) -> usize {
        MAX_TEMPLATE_WORK
            .saturating_sub(self.work.load(Relaxed))
            .saturating_add(1)
    }

    /// Counts comparing `v` with other values: its strings' bytes and its items, all the way
    /// down, as two equal values compare all of them.
    fn compare(&self, v: &Value) -> Result<(), Error> {
        self.work(compare_units(v, self.left()))
    }

    /// `v`, if it is a lazy list (a join, repeat, slice or reverse of other lists), copied into
    /// a plain list, the copy counted; anything else unchanged. A list made from plain lists
    /// walks in about its length, one made from lazy lists may not (see the module's notes).
    fn flat(&self, v: Value) -> Result<Value, Error> {
        if !is_list(&v) || v.downcast_object_ref::<Vec<Value>>().is_some() {
            return Ok(v);
        }
        let items: Vec<Value> = v.try_iter()?.take(MAX_TEMPLATE_LIST_ITEMS + 1).collect();
        self.list(items.len())?;
        self.walk(items.len())?;
        Ok(Value::from(items))
    }

    /// `v` where a builtin or `+` may walk or copy it: a list, string (its characters) or map
    /// of at most `MAX_TEMPLATE_LIST_ITEMS` items. An iterable of unknown length is collected
    /// into a list (up to one item past the limit) and that list stands in for it, so a one-shot
    /// iterator is not used up by counting it. An empty list is replaced by a new one: minijinja
    /// joins lists lazily, and an empty list added to itself over and over makes a chain of
    /// billions of links that hold no item, which take as long to walk.
    fn items(&self, v: Value) -> Result<Value, Error> {
        if !matches!(
            v.kind(),
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map | ValueKind::String
        ) {
            return Ok(v);
        }
        match v.len() {
            Some(0) if is_list(&v) => Ok(Value::from(Vec::<Value>::new())),
            Some(n) => self.list(n).map(|()| v),
            None => {
                let items: Vec<Value> = v.try_iter()?.take(MAX_TEMPLATE_LIST_ITEMS + 1).collect();
                self.list(items.len())?;
                Ok(Value::from(items))
            }
        }
    }

    /// Counts `len` more bytes written, failing past the output limit.
    fn write(&self, len: usize) -> Result<(), Error> {
        let total = self.written.load(Relaxed).saturating_add(len);
        self.written.store(total, Relaxed);
        if total <= MAX_TEMPLATE_OUTPUT_BYTES {
            return Ok(());
        }
        self.output_exceeded.store(true, Relaxed);
        Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "output passes the limit of {MAX_TEMPLATE_OUTPUT_BYTES} bytes \
                 (MAX_TEMPLATE_OUTPUT_BYTES)"
            ),
        ))
    }

    fn unwritten(&self) -> usize {
        MAX_TEMPLATE_OUTPUT_BYTES.saturating_sub(self.written.load(Relaxed))
    }
}

// The checks `checked` puts in the code, as filters. A filter name is looked up in the
// environment only (a template variable cannot stand in for it), and these are not
// identifiers, so a template cannot call them by name either.
const CHECK_MUL: &str = "%check*";
const CHECK_ADD: &str = "%check+";
const CHECK_CONCAT: &str = "%check~";
const CHECK_IN: &str = "%check-in";
const CHECK_SLICE: &str = "%check-slice";
const CHECK_SLICED: &str = "%check-sliced";
const CHECK_COMPARE: &str = "%check-compare";
const CHECK_GET_ITEM: &str = "%check-get-item";
const CHECK_EMIT: &str = "%check-emit";
const CHECK_EMIT_RAW: &str = "%check-emit-raw";

/// `code` with a check in front of each instruction that can make a string or list, walk or
/// compare one, or write text: `*`, `+`, `~`, `in`, comparisons, indexing and slices pass
/// their operands through a check that computes the length of the string or list they would
/// make and counts the work (and hands the operands back, as a list that `UnpackList` spreads
/// onto the stack again); `{{ }}` and template text add their length to the bytes written. A slice also gets a check after it,
/// which collects the slice it made. Jump targets and macro entry points move with the
/// instructions they point at (to the first check in front), and each added instruction
/// carries the location of the one it checks, so errors point at the template line as
/// before.
pub(super) fn checked<'s>(code: &Instructions<'s>) -> Instructions<'s> {
    let old: Vec<Instruction<'s>> = (0..).map_while(|i| code.get(i).cloned()).collect();
    // Where each old instruction starts in the new code (at its first check), and the end.
    let mut start = Vec::with_capacity(old.len() + 1);
    let mut next = 0u32;
    for instr in &old {
        start.push(next);
        let (before, after) = checks_for(instr);
        next += (before.len() + 1 + after.len()) as u32;
    }
    start.push(next);

    let mut new = Instructions::new(code.name(), code.source());
    for (i, mut instr) in old.into_iter().enumerate() {
        let i = i as u32;
        if let Some(target) = jump_target(&mut instr) {
            *target = start.get(*target as usize).copied().unwrap_or(next);
        }
        let (span, line) = (code.get_span(i), code.get_line(i));
        let (before, after) = checks_for(&instr);
        for one in before.into_iter().chain([instr]).chain(after) {
            match (span, line) {
                (Some(span), _) => new.add_with_span(one, span),
                (None, Some(line)) => new.add_with_line(one, line as u16),
                (None, None) => new.add(one),
            };
        }
    }
    new
}

/// The checks that go in front of `instr` and after it.
type Checks<'s> = (Vec<Instruction<'s>>, Vec<Instruction<'s>>);

fn checks_for<'s>(instr: &Instruction<'s>) -> Checks<'s> {
    // Local id !0: look the filter up each time rather than in the VM's small per-template
    // cache of filters, whose slots the compiler has handed out already.
    let operands = |name, n| {
        vec![
            Instruction::ApplyFilter(name, Some(n), !0),
            Instruction::UnpackList(n.into()),
        ]
    };
    let before = match instr {
        Instruction::Mul => operands(CHECK_MUL, 2),
        Instruction::Add => operands(CHECK_ADD, 2),
        Instruction::StringConcat => operands(CHECK_CONCAT, 2),
        // `in`, and in a chain of comparisons (`a < b in c`) every step, as minijinja keeps
        // the kind of comparison to itself.
        Instruction::In | Instruction::CompareAndPreserve(_) => operands(CHECK_IN, 2),
        Instruction::Eq
        | Instruction::Ne
        | Instruction::Gt
        | Instruction::Gte
        | Instruction::Lt
        | Instruction::Lte => operands(CHECK_COMPARE, 2),
        // The value, start, stop and step.
        Instruction::Slice => operands(CHECK_SLICE, 4),
        Instruction::GetItem => operands(CHECK_GET_ITEM, 2),
        Instruction::Emit => vec![Instruction::ApplyFilter(CHECK_EMIT, Some(1), !0)],
        Instruction::EmitRaw(text) => vec![
            Instruction::LoadConst(Value::from(text.len())),
            Instruction::ApplyFilter(CHECK_EMIT_RAW, Some(1), !0),
            Instruction::DiscardTop,
        ],
        _ => Vec::new(),
    };
    let after = match instr {
        Instruction::Slice => vec![Instruction::ApplyFilter(CHECK_SLICED, Some(1), !0)],
        _ => Vec::new(),
    };
    (before, after)
}

/// The instruction index `instr` holds, if any. Every instruction is named, so that a
/// minijinja release that adds one fails to compile here until it is sorted into one arm.
fn jump_target<'a>(instr: &'a mut Instruction<'_>) -> Option<&'a mut u32> {
    use Instruction as I;
    match instr {
        I::Jump(t)
        | I::JumpIfFalse(t)
        | I::JumpIfFalseOrPop(t)
        | I::JumpIfTrueOrPop(t)
        | I::Iterate(t)
        | I::BuildMacro(_, t, _) => Some(t),
        I::EmitRaw(_)
        | I::StoreLocal(_)
        | I::Lookup(_)
        | I::GetAttr(_)
        | I::SetAttr(_)
        | I::GetItem
        | I::Slice
        | I::LoadConst(_)
        | I::BuildMap(_)
        | I::BuildKwargs(_)
        | I::MergeKwargs(_)
        | I::BuildList(_)
        | I::UnpackList(_)
        | I::UnpackLists(_)
        | I::Add
        | I::Sub
        | I::Mul
        | I::Div
        | I::IntDiv
        | I::Rem
        | I::Pow
        | I::Neg
        | I::Eq
        | I::Ne
        | I::Gt
        | I::Gte
        | I::Lt
        | I::Lte
        | I::Not
        | I::StringConcat
        | I::In
        | I::CompareAndPreserve(_)
        | I::ApplyFilter(..)
        | I::PerformTest(..)
        | I::Emit
        | I::PushLoop(_)
        | I::PushWith
        | I::PushDidNotIterate
        | I::PopFrame
        | I::PopLoopFrame
        | I::PushAutoEscape
        | I::PopAutoEscape
        | I::BeginCapture(_)
        | I::EndCapture
        | I::CallFunction(..)
        | I::CallMethod(..)
        | I::CallObject(_)
        | I::DupTop
        | I::DiscardTop
        | I::FastSuper
        | I::FastRecurse
        | I::Swap
        | I::CallBlock(_)
        | I::LoadBlocks
        | I::Include(_)
        | I::ExportLocals
        | I::Return
        | I::IsUndefined
        | I::Enclose(_)
        | I::GetClosure => None,
    }
}

/// Bytes of `v` as text (what `~`, `{{ }}` and `join` make of it), counted without building
/// it and only up to just past `cap`: a lazily repeated list can stand for gigabytes.
pub(super) fn text_len(v: &Value, cap: usize) -> usize {
    text_len_as(v, cap, false)
}

/// [`text_len`], or with `pretty` the length of `pprint`'s `{:#?}`.
fn text_len_as(v: &Value, cap: usize, pretty: bool) -> usize {
    if v.kind() == ValueKind::String && !pretty {
        if let Some(s) = v.as_str() {
            return s.len();
        }
    }
    struct Count {
        len: usize,
        cap: usize,
    }
    impl fmt::Write for Count {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.len = self.len.saturating_add(s.len());
            if self.len > self.cap {
                Err(fmt::Error)
            } else {
                Ok(())
            }
        }
    }
    // A list prints as `[a, b]` and a map as `{k: v}`, at least 3 bytes an item; a lazily
    // repeated list of billions of items would take seconds to print even into nothing.
    if matches!(
        v.kind(),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
    ) {
        if let Some(items) = v.len() {
            if items.saturating_mul(3) > cap {
                return cap.saturating_add(1);
            }
        }
    }
    let mut count = Count { len: 0, cap };
    let _ = if pretty {
        write!(count, "{v:#?}")
    } else {
        write!(count, "{v}")
    };
    count.len
}

/// How much longer than its text a value gets when written under `state`'s escaping.
fn escape_growth(state: &State) -> usize {
    if matches!(state.auto_escape(), AutoEscape::None) {
        1
    } else {
        MAX_ESCAPE_GROWTH
    }
}

/// The operands of a checked binary operator, as `UnpackList(2)` restores them.
fn operands(lhs: &Value, rhs: &Value) -> Value {
    Value::from(vec![rhs.clone(), lhs.clone()])
}

/// Work of `item in container`: a string is scanned for the item's text; a list is walked,
/// each of its items compared with `item`, which can take as long as comparing `item` with
/// itself; a map looks the item up.
fn contains_work(b: &Budget, item: &Value, container: &Value) -> Result<(), Error> {
    if let Some(s) = container.as_str() {
        let item_len = item
            .as_str()
            .map_or_else(|| contains_len(container, item).unwrap_or(0), str::len);
        return b.bytes(s.len().saturating_add(item_len));
    }
    match container.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            let items = container.len().unwrap_or(0);
            b.work(items.saturating_mul(compare_units(item, b.left())))
        }
        ValueKind::Map => b.compare(item),
        _ => Ok(()),
    }
}

/// Work of `container[key]`: a map compares the key with its keys; a string and an iterable
/// (which minijinja indexes by walking it) walk up to the item; a list indexes at once.
fn get_item_work(b: &Budget, container: &Value, key: &Value) -> Result<(), Error> {
    let steps = |len: usize| match key.as_i64() {
        Some(i) if i >= 0 => usize::try_from(i).map_or(len, |i| i.saturating_add(1).min(len)),
        _ => len,
    };
    match container.kind() {
        ValueKind::Map => b.compare(key),
        ValueKind::String if key.is_integer() => {
            b.chars(steps(container.as_str().map_or(0, str::len)))
        }
        ValueKind::Iterable if key.is_integer() => {
            b.walk(steps(container.len().unwrap_or(MAX_TEMPLATE_LIST_ITEMS)))
        }
        _ => Ok(()),
    }
}

/// Work of comparing `lhs` with `rhs` (`==`, `<`, ...): strings compare up to the shorter one,
/// lists and maps item by item; numbers and the like are one instruction's work.
fn compare_work(b: &Budget, lhs: &Value, rhs: &Value) -> Result<(), Error> {
    // The sort of value and its size, for the values that compare piece by piece.
    let size = |v: &Value| match v.kind() {
        ValueKind::String => v.as_str().map(|s| (0, s.len())),
        ValueKind::Seq | ValueKind::Iterable => v.len().map(|n| (1, n)),
        ValueKind::Map => v.len().map(|n| (2, n)),
        _ => None,
    };
    match (size(lhs), size(rhs)) {
        (Some((l, left)), Some((r, right))) if l == r => {
            b.compare(if left <= right { lhs } else { rhs })
        }
        _ => Ok(()),
    }
}

/// Units of work in comparing all of `v` (see `Budget::compare`), counted up to `cap`. The
/// count keeps a walk per level on the heap, not the stack: a list can nest deeper than the
/// stack allows.
fn compare_units(v: &Value, cap: usize) -> usize {
    let mut units = 0usize;
    let mut walks: Vec<Box<dyn Iterator<Item = Value>>> =
        vec![Box::new(std::iter::once(v.clone()))];
    while let Some(walk) = walks.last_mut() {
        if units >= cap {
            break;
        }
        let Some(v) = walk.next() else {
            walks.pop();
            continue;
        };
        units += 1;
        match v.kind() {
            ValueKind::String => units += v.as_str().map_or(0, str::len) / BYTES_PER_WORK,
            // An iterable of unknown length may be a one-shot iterator, which counting must
            // not use up.
            ValueKind::Seq | ValueKind::Iterable if v.len().is_some() => {
                if let Ok(items) = v.try_iter() {
                    walks.push(Box::new(items));
                }
            }
            ValueKind::Map => {
                if let Ok(keys) = v.try_iter() {
                    walks.push(Box::new(keys.flat_map(move |key| {
                        let value = v.get_item(&key).unwrap_or_default();
                        [key, value]
                    })));
                }
            }
            _ => {}
        }
    }
    units
}

/// Bytes of the string `lhs * rhs` makes, when it repeats a string (minijinja picks the
/// string on the left first).
fn repeat_len(lhs: &Value, rhs: &Value) -> Option<usize> {
    let (s, n) = lhs
        .as_str()
        .map(|s| (s, rhs))
        .or_else(|| rhs.as_str().map(|s| (s, lhs)))?;
    Some(s.len().saturating_mul(n.as_usize()?))
}

/// What minijinja's `*` and `+` treat as a list.
fn is_list(v: &Value) -> bool {
    matches!(v.kind(), ValueKind::Seq | ValueKind::Iterable)
}

/// Items of the list `lhs * rhs` makes when it repeats a list of known length, and of the list
/// repeated (minijinja tries a string first, then a list on the left, then on the right).
fn list_repeat(lhs: &Value, rhs: &Value) -> Option<(usize, usize)> {
    if lhs.as_str().is_some() || rhs.as_str().is_some() {
        return None;
    }
    let (list, n) = [(lhs, rhs), (rhs, lhs)]
        .into_iter()
        .find(|(l, _)| l.as_object().is_some() && is_list(l))?;
    let len = list.len()?;
    Some((len.saturating_mul(n.as_usize()?), len))
}

/// Items of `lhs + rhs` when it joins two lists of known length.
fn list_add_len(lhs: &Value, rhs: &Value) -> Option<usize> {
    if !(is_list(lhs) && is_list(rhs)) {
        return None;
    }
    Some(lhs.len()?.saturating_add(rhs.len()?))
}

/// Bytes of `lhs + rhs` when it joins two strings.
fn add_len(lhs: &Value, rhs: &Value) -> Option<usize> {
    Some(lhs.as_str()?.len().saturating_add(rhs.as_str()?.len()))
}

/// Bytes of `lhs ~ rhs`, counted up to just past the limit.
fn concat_len(lhs: &Value, rhs: &Value) -> usize {
    let cap = MAX_TEMPLATE_STRING_BYTES;
    text_len(lhs, cap).saturating_add(text_len(rhs, cap))
}

/// Bytes of the text `item in container` makes of `item`: a string container looks for the
/// item written out.
fn contains_len(container: &Value, item: &Value) -> Option<usize> {
    (container.as_str().is_some() && item.as_str().is_none())
        .then(|| text_len(item, MAX_TEMPLATE_STRING_BYTES))
}

/// Puts the checks into `env`, all counting against `budget`: the filters `checked` code
/// calls, the string builtins behind their checks, and Python's string methods (from
/// minijinja-contrib) behind theirs.
pub(super) fn install(env: &mut Environment<'static>, budget: &Arc<Budget>) {
    add_checks(env, budget);
    add_string_builtins(env, budget);
    add_list_builtins(env, budget);
    let b = budget.clone();
    env.set_unknown_method_callback(move |state, value, method, args| {
        b.walk_value(value)?;
        if let Some(s) = value.as_str().filter(|_| value.kind() == ValueKind::String) {
            let bound = method_result_bound(state, value, method, args);
            b.string(bound)?;
            match method {
                "upper" | "lower" | "title" | "capitalize" => b.work(s.len())?,
                m if m.starts_with("is") => b.chars(s.len())?,
                _ => b.bytes(bound)?,
            }
            args.iter().try_for_each(|a| b.walk_value(a))?;
            let items = method_result_items(s, method, args);
            b.list(items)?;
            b.walk(items)?;
            // minijinja-contrib looks for an empty string at the same place for ever; Python
            // counts one between each two characters and at both ends.
            if method == "count" && args.first().and_then(Value::as_str) == Some("") {
                return Ok(Value::from(s.chars().count() + 1));
            }
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
}

pub(super) use constants::{check as check_constants, Exceeded};

fn add_checks(env: &mut Environment<'static>, budget: &Arc<Budget>) {
    let b = budget.clone();
    env.add_filter(CHECK_MUL, move |lhs: &Value, rhs: &Value| {
        if let Some(len) = repeat_len(lhs, rhs) {
            b.string(len)?;
            b.bytes(len)?;
        }
        match list_repeat(lhs, rhs) {
            // Repeating an empty list n times makes a list that takes n steps to walk.
            Some((_, 0)) => Ok(operands(&Value::from(Vec::<Value>::new()), &Value::from(0))),
            // The repeat is lazy, and walks in its length if what it repeats does.
            Some((items, _)) => {
                b.list(items)?;
                Ok(operands(&b.flat(lhs.clone())?, &b.flat(rhs.clone())?))
            }
            None => Ok(operands(lhs, rhs)),
        }
    });
    let b = budget.clone();
    env.add_filter(CHECK_ADD, move |lhs: &Value, rhs: &Value| {
        if let Some(len) = add_len(lhs, rhs) {
            b.string(len)?;
            b.bytes(len)?;
        }
        if !(is_list(lhs) && is_list(rhs)) {
            return Ok(operands(lhs, rhs));
        }
        let (lhs, rhs) = (b.items(lhs.clone())?, b.items(rhs.clone())?);
        b.list(
            lhs.len()
                .unwrap_or(0)
                .saturating_add(rhs.len().unwrap_or(0)),
        )?;
        // minijinja joins the two lazily; over plain lists the join walks in its length.
        // Growing a list one item at a time therefore copies it at each step (as Python's
        // `+` does), and the copies are counted.
        b.work(1)?;
        Ok(operands(&b.flat(lhs)?, &b.flat(rhs)?))
    });
    let b = budget.clone();
    env.add_filter(CHECK_CONCAT, move |lhs: &Value, rhs: &Value| {
        let cap = MAX_TEMPLATE_STRING_BYTES;
        let (left, right) = (text_len(lhs, cap), text_len(rhs, cap));
        b.string(left.saturating_add(right))?;
        b.text(lhs, left)?;
        b.text(rhs, right)?;
        Ok(operands(lhs, rhs))
    });
    let b = budget.clone();
    env.add_filter(CHECK_IN, move |item: &Value, container: &Value| {
        b.string(contains_len(container, item).unwrap_or(0))?;
        contains_work(&b, item, container)?;
        Ok(operands(item, container))
    });
    let b = budget.clone();
    env.add_filter(CHECK_COMPARE, move |lhs: &Value, rhs: &Value| {
        compare_work(&b, lhs, rhs)?;
        Ok(operands(lhs, rhs))
    });
    let b = budget.clone();
    env.add_filter(CHECK_GET_ITEM, move |container: &Value, key: &Value| {
        get_item_work(&b, container, key)?;
        Ok(operands(container, key))
    });
    let b = budget.clone();
    env.add_filter(CHECK_SLICE, move |args: Rest<Value>| {
        // A slice skips its start item by item and a backwards one copies the whole list
        // first: at most one walk of what it slices.
        match args.first() {
            Some(v) if v.kind() == ValueKind::String => b.chars(v.as_str().map_or(0, str::len))?,
            Some(v) => b.walk_value(v)?,
            None => {}
        }
        Ok(Value::from(args.0.into_iter().rev().collect::<Vec<_>>()))
    });
    let b = budget.clone();
    env.add_filter(CHECK_SLICED, move |v: Value| {
        // minijinja's slice of a list is lazy and skips its start again at every walk:
        // collected here, the slice walks in its length. It stays an iterable, as minijinja
        // makes it.
        if v.kind() != ValueKind::Iterable {
            return Ok(v);
        }
        let items: Vec<Value> = v.try_iter()?.take(MAX_TEMPLATE_LIST_ITEMS + 1).collect();
        b.list(items.len())?;
        b.walk(items.len())?;
        Ok(Value::make_object_iterable(items, |items| {
            Box::new(items.iter().cloned())
        }))
    });
    let b = budget.clone();
    env.add_filter(CHECK_EMIT, move |state: &State, v: &Value| {
        b.write(text_len(v, b.unwritten()).saturating_mul(escape_growth(state)))?;
        Ok(v.clone())
    });
    let b = budget.clone();
    env.add_filter(CHECK_EMIT_RAW, move |len: usize| {
        b.write(len)?;
        Ok(Value::UNDEFINED)
    });
}

/// minijinja's filters and tests that can make a string much longer than they are given
/// (`join`, `replace`, `indent`, `format`, changing case, escaping), or that write out a value
/// given to them as text (a list of one long string repeated prints as gigabytes), each
/// behind a check of the longest string its arguments allow.
fn add_string_builtins(env: &mut Environment<'static>, budget: &Arc<Budget>) {
    use minijinja::{filters as f, tests as t};
    type Bound = fn(&State, &[Value]) -> usize;
    let filters: [(&str, Value, Bound); 14] = [
        ("join", Value::from_function(f::join), join_bound),
        (
            "replace",
            Value::from_function(f::replace),
            |state, args| replace_bound(state, args, args.get(1), args.get(2)),
        ),
        ("indent", Value::from_function(f::indent), indent_bound),
        ("format", Value::from_function(f::format), format_bound),
        ("upper", Value::from_function(f::upper), case_bound),
        ("lower", Value::from_function(f::lower), case_bound),
        ("title", Value::from_function(f::title), case_bound),
        (
            "capitalize",
            Value::from_function(f::capitalize),
            case_bound,
        ),
        ("escape", Value::from_function(f::escape), escape_bound),
        ("e", Value::from_function(f::escape), escape_bound),
        ("pprint", Value::from_function(f::pprint), |_, args| {
            args.first().map_or(0, |v| text_len_as(v, TOO_LONG, true))
        }),
        ("trim", Value::from_function(f::trim), first_text_bound),
        ("string", Value::from_function(f::string), first_text_bound),
        ("safe", Value::from_function(f::safe), first_text_bound),
    ];
    for (name, builtin, bound) in filters {
        let b = budget.clone();
        env.add_filter(name, move |state: &State, args: Rest<Value>| {
            let len = bound(state, &args);
            b.string(len)?;
            // `join` walks its list, and copies strings or writes out other values; the
            // others make their text of their first argument.
            match (name, args.first()) {
                ("join", Some(items)) => {
                    b.walk(items.len().unwrap_or(0))?;
                    b.bytes(len)?;
                }
                ("upper" | "lower" | "title" | "capitalize", Some(_)) => b.work(len)?,
                (_, Some(v)) => b.text(v, len)?,
                (_, None) => {}
            }
            builtin.call(state, &args)
        });
    }
    let tests: [(&str, Value, Bound); 3] = [
        (
            "startingwith",
            Value::from_function(t::is_startingwith),
            all_text_bound,
        ),
        (
            "endingwith",
            Value::from_function(t::is_endingwith),
            all_text_bound,
        ),
        ("in", Value::from_function(t::is_in), |_, args| match args {
            [item, container, ..] => contains_len(container, item).unwrap_or(0),
            _ => 0,
        }),
    ];
    for (name, builtin, bound) in tests {
        let b = budget.clone();
        env.add_test(name, move |state: &State, args: Rest<Value>| {
            let len = bound(state, &args);
            b.string(len)?;
            match (name, &args[..]) {
                ("in", [item, container, ..]) => contains_work(&b, item, container)?,
                _ => b.bytes(len)?,
            }
            builtin.call(state, &args).map(|v| v.is_true())
        });
    }
    // `debug()` writes out every variable in scope at once.
    env.remove_global("debug");
}

fn first_text_bound(_: &State, args: &[Value]) -> usize {
    args.first().map_or(0, |v| text_len(v, TOO_LONG))
}

fn all_text_bound(_: &State, args: &[Value]) -> usize {
    args.iter()
        .map(|v| text_len(v, TOO_LONG))
        .max()
        .unwrap_or(0)
}

/// Changing case makes a character at most three times longer (`ΐ` becomes `Ϊ́`); only a
/// string long enough for that to matter is counted character by character.
fn case_bound(_: &State, args: &[Value]) -> usize {
    let Some(text) = args.first().map(text_of) else {
        return 0;
    };
    let Some(text) = text else {
        return TOO_LONG;
    };
    if text.len().saturating_mul(3) <= MAX_TEMPLATE_STRING_BYTES {
        return text.len();
    }
    let case_len = |c: char| {
        let upper: usize = c.to_uppercase().map(char::len_utf8).sum();
        let lower: usize = c.to_lowercase().map(char::len_utf8).sum();
        upper.max(lower)
    };
    text.chars().map(case_len).fold(0, usize::saturating_add)
}

/// HTML escaping writes each of `<>&"'/` as at most six bytes.
fn escape_bound(_: &State, args: &[Value]) -> usize {
    match args.first() {
        Some(v) if v.kind() == ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            let special = s.bytes().filter(|b| b"<>&\"'/".contains(b)).count();
            s.len()
                .saturating_add(special.saturating_mul(MAX_ESCAPE_GROWTH - 1))
        }
        Some(v) => text_len(v, TOO_LONG).saturating_mul(MAX_ESCAPE_GROWTH),
        None => 0,
    }
}

/// Text of `v` if it is a string or prints as one of at most `MAX_TEMPLATE_STRING_BYTES`.
fn text_of(v: &Value) -> Option<Cow<'_, str>> {
    match v.as_str() {
        Some(s) if v.kind() == ValueKind::String => Some(s.into()),
        _ if text_len(v, MAX_TEMPLATE_STRING_BYTES) > MAX_TEMPLATE_STRING_BYTES => None,
        _ => Some(v.to_string().into()),
    }
}

/// Past the limit: the result of a filter whose input is too long to look at.
const TOO_LONG: usize = MAX_TEMPLATE_STRING_BYTES + 1;

fn join_bound(state: &State, args: &[Value]) -> usize {
    let (Some(seq), joiner) = (args.first(), args.get(1)) else {
        return 0;
    };
    let joiner = joiner
        .filter(|j| !j.is_undefined() && !j.is_none())
        .map_or(0, |j| text_len(j, TOO_LONG));
    let Ok(items) = seq.try_iter() else {
        return 0;
    };
    let mut len = 0usize;
    for (i, item) in items.enumerate() {
        let sep = if i > 0 { joiner } else { 0 };
        len = len
            .saturating_add(sep)
            .saturating_add(text_len(&item, TOO_LONG).saturating_mul(escape_growth(state)));
        if len > MAX_TEMPLATE_STRING_BYTES {
            break;
        }
    }
    len
}

/// Length of `text` with every `from` replaced by `to`.
fn replace_bound(state: &State, args: &[Value], from: Option<&Value>, to: Option<&Value>) -> usize {
    let (Some(text), Some(from), Some(to)) = (args.first(), from, to) else {
        return 0;
    };
    let (Some(text), Some(from)) = (text_of(text), text_of(from)) else {
        return TOO_LONG;
    };
    let count = if from.is_empty() {
        text.chars().count() + 1
    } else {
        text.matches(from.as_ref()).count()
    };
    let to = text_len(to, TOO_LONG).saturating_mul(escape_growth(state));
    text.len()
        .saturating_mul(escape_growth(state))
        .saturating_add(count.saturating_mul(to))
}

fn indent_bound(_: &State, args: &[Value]) -> usize {
    let Some(text) = args.first() else {
        return 0;
    };
    let kwargs = args.iter().find(|a| a.is_kwargs());
    let width = args
        .get(1)
        .filter(|a| !a.is_kwargs())
        .cloned()
        .or_else(|| kwargs.and_then(|k| k.get_attr("width").ok()))
        .and_then(|w| w.as_usize())
        .unwrap_or(4);
    let Some(text) = text_of(text) else {
        return TOO_LONG;
    };
    let lines = text.bytes().filter(|&c| c == b'\n').count() + 1;
    text.len().saturating_add(lines.saturating_mul(width))
}

/// printf-style `format` and Python's `str.format`: the format string, the numbers in it
/// (widths and precisions, which pad), and for each place that takes an argument the longest
/// argument (plus room for a float written out in full).
fn format_bound(state: &State, args: &[Value]) -> usize {
    let Some(fmt) = args.first().and_then(|f| f.as_str()) else {
        return 0;
    };
    let longest_arg = args[1..]
        .iter()
        .map(|a| text_len(a, TOO_LONG).saturating_mul(escape_growth(state)))
        .max()
        .unwrap_or(0);
    let places = fmt.bytes().filter(|&c| c == b'%' || c == b'{').count();
    let numbers = fmt
        .split(|c: char| !c.is_ascii_digit())
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<usize>().unwrap_or(usize::MAX))
        .fold(0usize, usize::saturating_add);
    fmt.len()
        .saturating_add(numbers)
        .saturating_add(places.saturating_mul(longest_arg.saturating_add(400)))
}

/// minijinja's filters that build a list from a list, string or map, or walk one item by item
/// into a new one or a sum, each behind a check of the items it is given (`Budget::items`,
/// whose copy of an iterable of unknown length the filter then gets), the walk counted as
/// work, and, for those that cut into pieces, of the pieces it makes.
fn add_list_builtins(env: &mut Environment<'static>, budget: &Arc<Budget>) {
    use minijinja::filters as f;
    /// Items of the result beyond the input's length: `batch` and `slice` pad with a filler
    /// up to their count.
    type Extra = fn(&[Value]) -> usize;
    let count_arg: Extra = |args| args.get(1).and_then(Value::as_usize).unwrap_or(0);
    let none: Extra = |_| 0;
    // The value (first argument) only, or every positional argument (`chain`, `zip`).
    let filters: [(&str, Value, bool, Extra); 19] = [
        ("list", Value::from_function(f::list), false, none),
        ("sort", Value::from_function(f::sort), false, none),
        ("reverse", Value::from_function(f::reverse), false, none),
        ("last", Value::from_function(f::last), false, none),
        ("unique", Value::from_function(f::unique), false, none),
        ("dictsort", Value::from_function(f::dictsort), false, none),
        ("items", Value::from_function(f::items), false, none),
        ("groupby", Value::from_function(f::groupby), false, none),
        ("batch", Value::from_function(f::batch), false, count_arg),
        ("slice", Value::from_function(f::slice), false, count_arg),
        ("map", Value::from_function(f::map), false, none),
        ("select", Value::from_function(f::select), false, none),
        ("reject", Value::from_function(f::reject), false, none),
        (
            "selectattr",
            Value::from_function(f::selectattr),
            false,
            none,
        ),
        (
            "rejectattr",
            Value::from_function(f::rejectattr),
            false,
            none,
        ),
        ("chain", Value::from_function(f::chain), true, none),
        ("sum", Value::from_function(f::sum), false, none),
        ("min", Value::from_function(f::min), false, none),
        ("max", Value::from_function(f::max), false, none),
    ];
    let zip = ("zip", Value::from_function(f::zip), true, none);
    for (name, builtin, all, extra) in filters.into_iter().chain([zip]) {
        let b = budget.clone();
        env.add_filter(name, move |state: &State, args: Rest<Value>| {
            let mut args = args.0;
            let mut total = extra(&args);
            let checked = if all { args.len() } else { 1 };
            for arg in args.iter_mut().take(checked).filter(|a| !a.is_kwargs()) {
                // A string stays whole where the filter makes a string of it (`reverse`,
                // `last`); its length is the string limit's to check.
                if arg.kind() == ValueKind::String && matches!(name, "reverse" | "last") {
                    b.chars(arg.as_str().map_or(0, str::len))?;
                    continue;
                }
                *arg = b.items(std::mem::take(arg))?;
                let items = arg.len().unwrap_or(0);
                total = total.saturating_add(items);
                // The builtins that compare items (sorting, picking the smallest, grouping,
                // dropping repeats, or testing each, as `select('eq', s)` does) can compare
                // every item in full.
                match name {
                    "sort" | "unique" | "min" | "max" | "groupby" | "dictsort" | "select"
                    | "reject" | "selectattr" | "rejectattr" => b.compare(arg)?,
                    _ => b.walk(items)?,
                }
            }
            b.list(total)?;
            let result = builtin.call(state, &args)?;
            if name == "chain" {
                return collect_chain(&b, state, &builtin, result);
            }
            Ok(result)
        });
    }
    // The pieces of a string, which can be a list of one item per byte.
    let (b, split) = (budget.clone(), Value::from_function(f::split));
    env.add_filter("split", move |state: &State, args: Rest<Value>| {
        let text = args.first().and_then(text_of);
        let sep = args.get(1).and_then(Value::as_str);
        let max = args
            .get(2)
            .and_then(Value::as_i64)
            .and_then(|n| usize::try_from(n).ok());
        let len = first_text_bound(state, &args);
        b.string(len)?;
        b.bytes(len)?;
        let pieces = text.map_or(0, |t| split_items(&t, sep, max));
        b.list(pieces)?;
        b.walk(pieces)?;
        split.call(state, &args)
    });
    let (b, lines) = (budget.clone(), Value::from_function(f::lines));
    env.add_filter("lines", move |state: &State, args: Rest<Value>| {
        let len = first_text_bound(state, &args);
        b.string(len)?;
        b.bytes(len)?;
        let text = args.first().and_then(text_of);
        let pieces = text.map_or(0, |t| t.lines().count());
        b.list(pieces)?;
        b.walk(pieces)?;
        lines.call(state, &args)
    });
}

/// `chain`'s result collected into one list of the same kind. minijinja joins what it chains
/// lazily, a chain of chains up to 32 deep, and flattens the parts of deeper ones: a list
/// chained one item at a time is a walk through up to 32 nested joins an item, and looking up
/// an item of it passes every part before. A map stays as minijinja merges it.
fn collect_chain(b: &Budget, state: &State, chain: &Value, result: Value) -> Result<Value, Error> {
    if !is_list(&result) {
        return Ok(result);
    }
    let items: Vec<Value> = result
        .try_iter()?
        .take(MAX_TEMPLATE_LIST_ITEMS + 1)
        .collect();
    b.list(items.len())?;
    b.walk(items.len())?;
    if result.kind() == ValueKind::Seq {
        // minijinja's chain of lists alone is a list that can be indexed; one part of it is.
        chain.call(state, &[Value::from(items)])
    } else {
        Ok(Value::make_object_iterable(items, |items| {
            Box::new(items.iter().cloned())
        }))
    }
}

/// Pieces `text.split(sep, max)` makes, counted without making them.
fn split_items(text: &str, sep: Option<&str>, max: Option<usize>) -> usize {
    let pieces = match sep {
        Some(sep) => text.split(sep).count(),
        None => text.split_whitespace().count(),
    };
    max.map_or(pieces, |m| pieces.min(m.saturating_add(1)))
}

/// Items of the list a Python string method of minijinja-contrib makes of `text`.
fn method_result_items(text: &str, method: &str, args: &[Value]) -> usize {
    match method {
        "split" => split_items(
            text,
            args.first().and_then(Value::as_str),
            args.get(1)
                .and_then(Value::as_i64)
                .and_then(|n| usize::try_from(n).ok()),
        ),
        "splitlines" => text.split('\n').count(),
        _ => 0,
    }
}

/// The longest string a Python string method of minijinja-contrib can return for these
/// arguments; 0 for the methods that return no longer string than they are given.
fn method_result_bound(state: &State, value: &Value, method: &str, args: &[Value]) -> usize {
    let with_value = || {
        std::iter::once(value.clone())
            .chain(args.iter().cloned())
            .collect::<Vec<_>>()
    };
    match method {
        "replace" => replace_bound(
            state,
            std::slice::from_ref(value),
            args.first(),
            args.get(1),
        ),
        "format" => format_bound(state, &with_value()),
        // `sep.join(items)`: the items with `sep` between them.
        "join" => match args.first() {
            Some(items) => join_bound(state, &[items.clone(), value.clone()]),
            None => 0,
        },
        "upper" | "lower" | "title" | "capitalize" => {
            case_bound(state, std::slice::from_ref(value))
        }
        _ => 0,
    }
}

/// minijinja's compiler evaluates an operator whose operands are constants (`'x' * 99999999`,
/// `'a' ~ 'b'`, `[0] * 99999999`) while it compiles, where none of the checks `checked` adds
/// can run. `check` walks the parsed template first and evaluates those constants the way the
/// compiler will, one operator at a time, each after the same length checks as at run time.
mod constants {
    use minijinja::machinery::ast::{self, BinOpKind, CallArg, Expr, Spanned, Stmt};
    use minijinja::machinery::Span;
    use minijinja::Value;

    use super::{
        add_len, concat_len, contains_len, list_add_len, list_repeat, repeat_len,
        MAX_TEMPLATE_LIST_ITEMS, MAX_TEMPLATE_STRING_BYTES,
    };

    /// A constant that would pass a limit.
    pub(in crate::tokenizer::chat) enum Exceeded {
        /// A string of this many bytes.
        String(usize),
        /// A list of this many items.
        List(usize),
    }

    type Checked<T> = Result<T, Exceeded>;

    /// Fails with the first constant in `template` that would pass a limit.
    pub(in crate::tokenizer::chat) fn check(template: &Stmt) -> Checked<()> {
        stmt(template)
    }

    fn stmts(body: &[Stmt]) -> Checked<()> {
        body.iter().try_for_each(stmt)
    }

    // Every statement and expression is named, so that a minijinja release that adds one fails
    // to compile here until it is walked.
    fn stmt(s: &Stmt) -> Checked<()> {
        match s {
            Stmt::Template(t) => stmts(&t.children),
            Stmt::EmitExpr(e) => expr(&e.expr),
            Stmt::EmitRaw(_) => Ok(()),
            Stmt::ForLoop(f) => {
                expr(&f.target)?;
                expr(&f.iter)?;
                f.filter_expr.iter().try_for_each(expr)?;
                stmts(&f.body)?;
                stmts(&f.else_body)
            }
            Stmt::IfCond(i) => {
                expr(&i.expr)?;
                stmts(&i.true_body)?;
                stmts(&i.false_body)
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    expr(target)?;
                    expr(value)?;
                }
                stmts(&w.body)
            }
            Stmt::Set(s) => {
                expr(&s.target)?;
                expr(&s.expr)
            }
            Stmt::SetBlock(s) => {
                expr(&s.target)?;
                s.filter.iter().try_for_each(expr)?;
                stmts(&s.body)
            }
            Stmt::AutoEscape(a) => {
                expr(&a.enabled)?;
                stmts(&a.body)
            }
            Stmt::FilterBlock(f) => {
                expr(&f.filter)?;
                stmts(&f.body)
            }
            Stmt::Block(b) => stmts(&b.body),
            Stmt::Import(i) => {
                expr(&i.expr)?;
                expr(&i.name)
            }
            Stmt::FromImport(f) => {
                expr(&f.expr)?;
                for (name, alias) in &f.names {
                    expr(name)?;
                    alias.iter().try_for_each(expr)?;
                }
                Ok(())
            }
            Stmt::Extends(e) => expr(&e.name),
            Stmt::Include(i) => expr(&i.name),
            Stmt::Macro(m) => macro_decl(m),
            Stmt::CallBlock(c) => {
                call(&c.call)?;
                macro_decl(&c.macro_decl)
            }
            Stmt::Do(d) => call(&d.call),
        }
    }

    fn macro_decl(m: &ast::Macro) -> Checked<()> {
        m.args.iter().chain(&m.defaults).try_for_each(expr)?;
        stmts(&m.body)
    }

    fn call(c: &ast::Call) -> Checked<()> {
        expr(&c.expr)?;
        args(&c.args)
    }

    fn args(args: &[CallArg]) -> Checked<()> {
        args.iter().try_for_each(|arg| match arg {
            CallArg::Pos(e)
            | CallArg::Kwarg(_, e)
            | CallArg::PosSplat(e)
            | CallArg::KwargSplat(e) => expr(e),
        })
    }

    fn expr(e: &Expr) -> Checked<()> {
        fold(e).map(drop)
    }

    /// The constant `e` compiles to, as the compiler's `Expr::as_const` folds it, or None
    /// where the compiler emits code instead (then its operands are folded on their own).
    fn fold(e: &Expr) -> Checked<Option<Value>> {
        Ok(match e {
            Expr::Const(c) => Some(c.value.clone()),
            Expr::List(l) => {
                l.items.iter().try_for_each(expr)?;
                l.as_const()
            }
            Expr::Map(m) => {
                m.keys.iter().chain(&m.values).try_for_each(expr)?;
                m.as_const()
            }
            Expr::UnaryOp(u) => fold(&u.expr)?.and_then(|v| {
                // A copy of the operator: `UnaryOpKind` is neither Copy nor Clone.
                #[allow(clippy::needless_match)]
                let op = match u.op {
                    ast::UnaryOpKind::Not => ast::UnaryOpKind::Not,
                    ast::UnaryOpKind::Neg => ast::UnaryOpKind::Neg,
                };
                Expr::UnaryOp(spanned(ast::UnaryOp {
                    op,
                    expr: constant(v),
                }))
                .as_const()
            }),
            Expr::BinOp(b) => match (fold(&b.left)?, fold(&b.right)?) {
                (Some(left), Some(right)) => {
                    let len = match b.op {
                        BinOpKind::Mul => repeat_len(&left, &right),
                        BinOpKind::Add => add_len(&left, &right),
                        BinOpKind::Concat => Some(concat_len(&left, &right)),
                        BinOpKind::In => contains_len(&right, &left),
                        _ => None,
                    };
                    within_limit(len)?;
                    let items = match b.op {
                        // An empty list repeated n times takes n steps to walk.
                        BinOpKind::Mul => {
                            list_repeat(&left, &right).map(|(items, len)| match len {
                                0 => left.as_usize().or(right.as_usize()).unwrap_or(0),
                                _ => items,
                            })
                        }
                        BinOpKind::Add => list_add_len(&left, &right),
                        _ => None,
                    };
                    if let Some(items) = items.filter(|&n| n > MAX_TEMPLATE_LIST_ITEMS) {
                        return Err(Exceeded::List(items));
                    }
                    let (left, right) = (constant(left), constant(right));
                    Expr::BinOp(spanned(ast::BinOp {
                        op: b.op,
                        left,
                        right,
                    }))
                    .as_const()
                }
                _ => None,
            },
            Expr::Compare(c) => {
                let first = fold(&c.expr)?;
                let rest = c
                    .ops
                    .iter()
                    .map(|op| fold(&op.expr))
                    .collect::<Checked<Vec<_>>>()?;
                let (Some(first), Some(rest)) =
                    (first, rest.into_iter().collect::<Option<Vec<_>>>())
                else {
                    return Ok(None);
                };
                let mut left = &first;
                for (op, right) in c.ops.iter().zip(&rest) {
                    if matches!(op.op, ast::CompareOpKind::In | ast::CompareOpKind::NotIn) {
                        within_limit(contains_len(right, left))?;
                    }
                    left = right;
                }
                let ops = c
                    .ops
                    .iter()
                    .zip(rest)
                    .map(|(op, value)| ast::CompareOp {
                        op: op.op,
                        expr: constant(value),
                    })
                    .collect();
                Expr::Compare(spanned(ast::Compare {
                    expr: constant(first),
                    ops,
                }))
                .as_const()
            }
            Expr::Var(_) => None,
            Expr::Slice(s) => {
                expr(&s.expr)?;
                [&s.start, &s.stop, &s.step]
                    .into_iter()
                    .flatten()
                    .try_for_each(expr)?;
                None
            }
            Expr::IfExpr(i) => {
                expr(&i.test_expr)?;
                expr(&i.true_expr)?;
                i.false_expr.iter().try_for_each(expr)?;
                None
            }
            Expr::Filter(f) => {
                f.expr.iter().try_for_each(expr)?;
                args(&f.args)?;
                None
            }
            Expr::Test(t) => {
                expr(&t.expr)?;
                args(&t.args)?;
                None
            }
            Expr::GetAttr(g) => {
                expr(&g.expr)?;
                None
            }
            Expr::GetItem(g) => {
                expr(&g.expr)?;
                expr(&g.subscript_expr)?;
                None
            }
            Expr::Call(c) => {
                call(c)?;
                None
            }
        })
    }

    fn within_limit(len: Option<usize>) -> Checked<()> {
        match len {
            Some(len) if len > MAX_TEMPLATE_STRING_BYTES => Err(Exceeded::String(len)),
            _ => Ok(()),
        }
    }

    fn spanned<T>(node: T) -> Spanned<T> {
        Spanned::new(node, Span::default())
    }

    fn constant<'a>(value: Value) -> Expr<'a> {
        Expr::Const(spanned(ast::Const { value }))
    }
}
