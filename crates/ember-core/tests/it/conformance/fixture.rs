//! The PyTorch reference cases: `manifest.json` parsed into [`Case`]s, and the tensors of
//! `reference.safetensors` loaded as ember tensors of their own dtype on a chosen device.
//!
//! Both files are embedded in the test binary (`include_bytes!`), so the tests need no path
//! at run time (the GPU bundle runs binaries away from the source tree).

use ember_core::{DType, Device, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::{Map, Value};

static MANIFEST: &str = include_str!("../../fixtures/conformance/manifest.json");
static REFERENCE: &[u8] = include_bytes!("../../fixtures/conformance/reference.safetensors");

/// One case of the manifest (see the header of `gen_reference.py` for the fields).
#[derive(Debug, Clone)]
pub struct Case {
    pub id: String,
    pub group: String,
    pub op: String,
    pub kwargs: Map<String, Value>,
    /// Input tensor names, in PyTorch's positional order.
    pub inputs: Vec<String>,
    /// Output tensor names, in PyTorch's order.
    pub outputs: Vec<String>,
    /// Upstream gradients, one per floating output, in output order (empty: no backward).
    pub grad_out: Vec<String>,
    /// (input name, name of its expected gradient).
    pub grads: Vec<(String, String)>,
    pub rtol: f64,
    pub atol: f64,
    /// The whole manifest entry, for fields only some groups have (optimizer `params`/`steps`,
    /// read by ember-nn's tests, which include this file).
    #[allow(dead_code)]
    pub raw: Value,
}

/// The manifest's cases plus the reference tensors.
pub struct Fixture {
    pub torch_version: String,
    pub cases: Vec<Case>,
    tensors: SafeTensors<'static>,
}

/// A reference tensor read back to the host: its PyTorch dtype, shape and values as f64.
#[derive(Debug, Clone)]
pub struct Reference {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

impl Case {
    fn parse(v: &Value) -> Case {
        let s = |k: &str| {
            v[k].as_str()
                .unwrap_or_else(|| panic!("case without {k}: {v}"))
                .to_owned()
        };
        Case {
            id: s("id"),
            group: s("group"),
            op: s("op"),
            kwargs: v["kwargs"].as_object().cloned().unwrap_or_default(),
            inputs: strings(v.get("inputs")),
            outputs: strings(v.get("outputs")),
            grad_out: strings(v.get("grad_out")),
            grads: v
                .get("grads")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, g)| (k.clone(), g.as_str().unwrap_or_default().to_owned()))
                        .collect()
                })
                .unwrap_or_default(),
            rtol: v["rtol"].as_f64().unwrap_or(0.0),
            atol: v["atol"].as_f64().unwrap_or(0.0),
            raw: v.clone(),
        }
    }

    /// The name of the expected gradient of input `name`, if the case has one.
    pub fn grad_of(&self, name: &str) -> Option<&str> {
        self.grads
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, g)| g.as_str())
    }
}

impl Fixture {
    /// Parses the embedded manifest and reference file.
    pub fn load() -> Fixture {
        Fixture::parse(MANIFEST, REFERENCE)
    }

    /// Parses another manifest and reference file of the same format (the mixed-precision
    /// cases of ember-nn's tests).
    pub fn parse(manifest: &'static str, reference: &'static [u8]) -> Fixture {
        let manifest: Value = serde_json::from_str(manifest).expect("manifest.json is valid JSON");
        let cases = manifest["cases"]
            .as_array()
            .expect("manifest has cases")
            .iter()
            .map(Case::parse)
            .collect();
        Fixture {
            torch_version: manifest["torch_version"].as_str().unwrap_or("?").to_owned(),
            cases,
            tensors: SafeTensors::deserialize(reference).expect("reference.safetensors is valid"),
        }
    }

    /// Tensor `<case id>/<name>` as an ember tensor of its own dtype on `device`.
    pub fn tensor(&self, case: &Case, name: &str, device: Device) -> Result<Tensor, String> {
        let key = format!("{}/{}", case.id, name);
        let view = self
            .tensors
            .tensor(&key)
            .map_err(|e| format!("reference tensor {key}: {e}"))?;
        let shape = view.shape().to_vec();
        let data = view.data();
        fn words<const N: usize, T>(data: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
            data.chunks_exact(N)
                .map(|c| f(c.try_into().expect("chunks_exact")))
                .collect()
        }
        let t = match view.dtype() {
            StDtype::F64 => Tensor::from_vec(words(data, f64::from_le_bytes), shape, device),
            StDtype::F32 => Tensor::from_vec(words(data, f32::from_le_bytes), shape, device),
            StDtype::F16 => Tensor::from_vec(
                words(data, |b| f16::from_bits(u16::from_le_bytes(b))),
                shape,
                device,
            ),
            StDtype::BF16 => Tensor::from_vec(
                words(data, |b| bf16::from_bits(u16::from_le_bytes(b))),
                shape,
                device,
            ),
            StDtype::I64 => Tensor::from_vec(words(data, i64::from_le_bytes), shape, device),
            StDtype::I32 => Tensor::from_vec(words(data, i32::from_le_bytes), shape, device),
            StDtype::U8 => Tensor::from_vec(data.to_vec(), shape, device),
            StDtype::BOOL => {
                Tensor::from_vec(data.iter().map(|&b| b != 0).collect::<Vec<bool>>(), shape, device)
            }
            other => {
                return Err(format!(
                    "reference tensor {key}: dtype {other:?} has no ember dtype"
                ))
            }
        };
        t.map_err(|e| format!("loading reference tensor {key}: {e}"))
    }

    /// Tensor `<case id>/<name>` read to the host, for comparing against.
    pub fn reference(&self, case: &Case, name: &str) -> Result<Reference, String> {
        let t = self.tensor(case, name, Device::Cpu)?;
        Ok(Reference {
            dtype: t.dtype(),
            shape: t.dims().to_vec(),
            values: t
                .to_vec_f64()
                .map_err(|e| format!("reading reference {}/{name}: {e}", case.id))?,
        })
    }
}
