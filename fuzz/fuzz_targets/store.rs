//! The TCP store's wire format: requests as the server reads them off a connection (served
//! against a fresh store, never blocking), and answers as the client reads them.
#![no_main]

use ember::distributed::store::fuzzing;

ember_fuzz::reader_target!(|data| {
    // One input feeds both sides: the server reads it as requests, the client as answers.
    fuzzing::decode(data, data);
});
