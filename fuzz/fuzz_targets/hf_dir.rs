#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| megainfer_fuzz::hf_dir(data));
