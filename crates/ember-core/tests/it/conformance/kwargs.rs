//! Typed access to a case's `kwargs` (PyTorch keyword arguments as JSON). A missing or
//! ill-typed argument is a runner failure; an argument the runner does not know is reported as
//! "not mapped", so a new generator option cannot be silently ignored.

use super::runner::Fail;
use ember_core::Scalar;
use serde_json::{Map, Value};

pub struct Kwargs<'a>(pub &'a Map<String, Value>);

fn bad(name: &str, want: &str, v: &Value) -> Fail {
    Fail::Failed(format!("runner: kwarg {name}={v} is not {want}"))
}

impl Kwargs<'_> {
    /// Rejects (as not mapped) any kwarg outside `known`.
    pub fn only(&self, known: &[&str]) -> Result<(), Fail> {
        match self.0.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(Fail::unmapped(format!("kwarg {k}={}", self.0[k]))),
            None => Ok(()),
        }
    }

    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn required(&self, name: &str) -> Result<&Value, Fail> {
        self.get(name)
            .ok_or_else(|| Fail::Failed(format!("runner: kwarg {name} is missing")))
    }

    /// A number as PyTorch would take a Python scalar: int stays int, float stays float.
    pub fn opt_scalar(&self, name: &str) -> Result<Option<Scalar>, Fail> {
        self.get(name)
            .map(|v| match v {
                Value::Bool(b) => Ok(Scalar::Bool(*b)),
                Value::Number(n) => Ok(n
                    .as_i64()
                    .map(Scalar::Int)
                    .unwrap_or(Scalar::Float(n.as_f64().unwrap_or(f64::NAN)))),
                _ => Err(bad(name, "a number", v)),
            })
            .transpose()
    }

    pub fn scalar(&self, name: &str) -> Result<Scalar, Fail> {
        self.required(name)?;
        Ok(self.opt_scalar(name)?.expect("checked present"))
    }

    pub fn opt_f64(&self, name: &str) -> Result<Option<f64>, Fail> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| bad(name, "a number", v)))
            .transpose()
    }

    pub fn f64(&self, name: &str) -> Result<f64, Fail> {
        let v = self.required(name)?;
        v.as_f64().ok_or_else(|| bad(name, "a number", v))
    }

    pub fn opt_dim(&self, name: &str) -> Result<Option<isize>, Fail> {
        self.get(name)
            .map(|v| {
                v.as_i64()
                    .map(|d| d as isize)
                    .ok_or_else(|| bad(name, "an int", v))
            })
            .transpose()
    }

    pub fn dim(&self, name: &str) -> Result<isize, Fail> {
        self.required(name)?;
        Ok(self.opt_dim(name)?.expect("checked present"))
    }

    pub fn i64(&self, name: &str) -> Result<i64, Fail> {
        let v = self.required(name)?;
        v.as_i64().ok_or_else(|| bad(name, "an int", v))
    }

    pub fn usize(&self, name: &str) -> Result<usize, Fail> {
        let v = self.required(name)?;
        v.as_u64()
            .map(|u| u as usize)
            .ok_or_else(|| bad(name, "a non-negative int", v))
    }

    /// An int or a list of ints (`dim=1` and `dim=[0, 2]` both give a list).
    pub fn opt_dims(&self, name: &str) -> Result<Option<Vec<isize>>, Fail> {
        let Some(v) = self.get(name) else { return Ok(None) };
        if let Some(d) = v.as_i64() {
            return Ok(Some(vec![d as isize]));
        }
        let list = v
            .as_array()
            .ok_or_else(|| bad(name, "an int or a list of ints", v))?;
        list.iter()
            .map(|d| {
                d.as_i64()
                    .map(|d| d as isize)
                    .ok_or_else(|| bad(name, "a list of ints", v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    pub fn dims(&self, name: &str) -> Result<Vec<isize>, Fail> {
        self.required(name)?;
        Ok(self.opt_dims(name)?.expect("checked present"))
    }

    pub fn bool_or(&self, name: &str, default: bool) -> Result<bool, Fail> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| bad(name, "a bool", v)))
            .unwrap_or(Ok(default))
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<&str>, Fail> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| bad(name, "a string", v)))
            .transpose()
    }

    pub fn str(&self, name: &str) -> Result<&str, Fail> {
        self.required(name)?;
        Ok(self.opt_str(name)?.expect("checked present"))
    }
}
