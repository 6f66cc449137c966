//! Distributed checkpoints (`ember::distributed::dcp`): one input read as the `.metadata` file
//! (JSON: every tensor's dtype, global shape and pieces, every file's size) and as a rank's
//! `.distcp` file (a safetensors header, the file's index of pieces, then each piece it lists
//! read whole), by the readers `dcp::load` runs.
#![no_main]

use ember::distributed::dcp::fuzzing;

ember_fuzz::reader_target!(|data| {
    let _ = fuzzing::metadata(data);
    let _ = fuzzing::shard_file(data);
});
