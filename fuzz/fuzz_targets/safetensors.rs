//! safetensors files (`state_dict::load_tensors`): the header's JSON, its dtypes, shapes and
//! offsets against the bytes present.
#![no_main]

use ember::nn::state_dict::load_tensors_from_bytes;
use ember::Device;

ember_fuzz::reader_target!(|data| {
    if let Ok(tensors) = load_tensors_from_bytes(data, Device::Cpu) {
        // What loaded is whole: every tensor reads back.
        for (_, t) in tensors {
            t.to_vec_f64().expect("a loaded tensor reads back");
        }
    }
});
