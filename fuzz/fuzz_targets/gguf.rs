#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| megainfer_fuzz::gguf(data));
