//! [`Layout`]: how a tensor's elements sit in its storage (shape, strides, offset).
//!
//! Views (permute, narrow, expand, ...) only make a new layout over the same storage.
//! Strides are in elements and never negative; a stride of 0 repeats an element (broadcast).

use crate::shape::Dims;
use crate::{Error, Result, Shape};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Dims,
    offset: usize,
}

impl Layout {
    /// The row-major layout of `shape` starting at element 0.
    pub fn contiguous(shape: impl Into<Shape>) -> Layout {
        let shape = shape.into();
        let strides = shape.contiguous_strides();
        Layout {
            shape,
            strides,
            offset: 0,
        }
    }

    pub fn new(shape: Shape, strides: impl Into<Dims>, offset: usize) -> Layout {
        let strides = strides.into();
        debug_assert_eq!(shape.rank(), strides.len());
        Layout {
            shape,
            strides,
            offset,
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// True when the elements are row-major and dense (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.dims().iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }

    /// The storage range holding the elements in order, if the layout is contiguous.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.numel())
    }

    /// One past the largest storage index this layout reaches (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset
            + self
                .dims()
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }

    pub fn permute(&self, dims: &[usize]) -> Result<Layout> {
        let rank = self.shape.rank();
        let mut seen = vec![false; rank];
        if dims.len() != rank
            || dims
                .iter()
                .any(|&d| d >= rank || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::invalid(
                "permute",
                format!("dims {dims:?} is not a permutation of 0..{rank}"),
            ));
        }
        let shape = dims.iter().map(|&d| self.dims()[d]).collect::<Vec<_>>();
        let strides: Dims = dims.iter().map(|&d| self.strides[d]).collect();
        Ok(Layout::new(shape.into(), strides, self.offset))
    }

    pub fn transpose(&self, d0: usize, d1: usize) -> Layout {
        let mut shape = self.dims().to_vec();
        let mut strides = self.strides.clone();
        shape.swap(d0, d1);
        strides.swap(d0, d1);
        Layout::new(shape.into(), strides, self.offset)
    }

    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let size = self.dims()[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::invalid(
                "narrow",
                format!("start ({start}) + length ({len}) exceeds dimension {dim} of size {size}"),
            ));
        }
        let mut shape = self.dims().to_vec();
        shape[dim] = len;
        let offset = if len == 0 {
            self.offset
        } else {
            self.offset + start * self.strides[dim]
        };
        Ok(Layout::new(shape.into(), self.strides.clone(), offset))
    }

    /// Drops `dim`, keeping element `index` of it.
    pub fn select(&self, dim: usize, index: usize) -> Result<Layout> {
        let size = self.dims()[dim];
        if index >= size {
            return Err(Error::IndexOutOfRange {
                op: "select",
                index: index as i64,
                dim,
                size,
            });
        }
        let mut shape = self.dims().to_vec();
        let mut strides = self.strides.clone();
        shape.remove(dim);
        let stride = strides.remove(dim);
        Ok(Layout::new(shape.into(), strides, self.offset + index * stride))
    }

    pub fn unsqueeze(&self, dim: usize) -> Layout {
        let mut shape = self.dims().to_vec();
        let mut strides = self.strides.clone();
        let stride = if dim < shape.len() {
            shape[dim] * strides[dim]
        } else {
            1
        };
        shape.insert(dim, 1);
        strides.insert(dim, stride);
        Layout::new(shape.into(), strides, self.offset)
    }

    /// Removes `dim` if its size is 1 (otherwise returns the layout unchanged, as PyTorch).
    pub fn squeeze(&self, dim: usize) -> Layout {
        if self.dims()[dim] != 1 {
            return self.clone();
        }
        let mut shape = self.dims().to_vec();
        let mut strides = self.strides.clone();
        shape.remove(dim);
        strides.remove(dim);
        Layout::new(shape.into(), strides, self.offset)
    }

    /// A view of this layout repeated (stride 0) to `shape`, under broadcasting rules.
    pub fn broadcast_as(&self, shape: &Shape, op: &'static str) -> Result<Layout> {
        let (src, dst) = (self.dims(), shape.dims());
        let err = || Error::ShapeMismatch {
            op,
            lhs: self.shape.clone(),
            rhs: shape.clone(),
            hint: "the tensor cannot be expanded to this shape",
        };
        if dst.len() < src.len() {
            return Err(err());
        }
        shape.checked_elements(op)?;
        let lead = dst.len() - src.len();
        let mut strides: Dims = smallvec::smallvec![0; dst.len()];
        for i in 0..src.len() {
            strides[lead + i] = match (src[i], dst[lead + i]) {
                (a, b) if a == b => self.strides[i],
                (1, _) => 0,
                _ => return Err(err()),
            };
        }
        Ok(Layout::new(shape.clone(), strides, self.offset))
    }

    /// The layout of `shape` over the same elements without copying, if one exists
    /// (PyTorch's `view` rule: each group of merged/split dims must be contiguous in itself).
    pub fn view(&self, shape: &Shape) -> Option<Layout> {
        if shape.numel() != self.numel() {
            return None;
        }
        if self.is_contiguous() {
            let mut l = Layout::contiguous(shape.clone());
            l.offset = self.offset;
            return Some(l);
        }
        // Walk old dims in chunks of elements that are contiguous with each other.
        let old_dims = self.dims();
        let new_dims = shape.dims();
        let mut new_strides: Dims = smallvec::smallvec![0; new_dims.len()];
        let mut view_d = new_dims.len() as isize - 1;
        let mut chunk_base_stride = *self.strides.last().unwrap_or(&1);
        let mut tensor_numel = 1;
        let mut view_numel = 1;
        for tensor_d in (0..old_dims.len()).rev() {
            tensor_numel *= old_dims[tensor_d];
            let chunk_ends = tensor_d == 0
                || (old_dims[tensor_d - 1] != 1
                    && self.strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
            if chunk_ends {
                while view_d >= 0 && (view_numel < tensor_numel || new_dims[view_d as usize] == 1) {
                    new_strides[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= new_dims[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = self.strides[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Some(Layout::new(shape.clone(), new_strides, self.offset))
    }

    /// Storage offsets of every element in row-major order.
    pub fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets::new(self, 0)
    }

    /// Storage offsets of the elements from row-major position `start` on (so that parallel
    /// kernels can give each thread its own range: `offsets_from(start).take(len)`).
    pub fn offsets_from(&self, start: usize) -> StridedOffsets<'_> {
        StridedOffsets::new(self, start)
    }
}

/// Iterator over the storage offsets of a layout, in row-major element order.
pub struct StridedOffsets<'a> {
    layout: &'a Layout,
    index: Vec<usize>,
    next: Option<usize>,
}

impl<'a> StridedOffsets<'a> {
    fn new(layout: &'a Layout, start: usize) -> Self {
        let dims = layout.dims();
        let mut index = vec![0; dims.len()];
        let mut offset = layout.offset;
        let mut rest = start;
        for d in (0..dims.len()).rev() {
            index[d] = rest % dims[d].max(1);
            rest /= dims[d].max(1);
            offset += index[d] * layout.strides[d];
        }
        StridedOffsets {
            layout,
            index,
            next: (start < layout.numel()).then_some(offset),
        }
    }
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        let current = self.next?;
        let dims = self.layout.dims();
        let strides = &self.layout.strides;
        let mut next = current;
        let mut d = dims.len();
        loop {
            if d == 0 {
                self.next = None;
                break;
            }
            d -= 1;
            if self.index[d] + 1 < dims[d] {
                self.index[d] += 1;
                next += strides[d];
                self.next = Some(next);
                break;
            }
            next -= self.index[d] * strides[d];
            self.index[d] = 0;
        }
        Some(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_offsets_walk_columns() {
        let l = Layout::contiguous([2, 3]).transpose(0, 1);
        assert_eq!(l.offsets().collect::<Vec<_>>(), vec![0, 3, 1, 4, 2, 5]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn offsets_from_resume_mid_tensor() {
        let l = Layout::contiguous([3, 4, 5]).permute(&[2, 0, 1]).unwrap();
        let all: Vec<usize> = l.offsets().collect();
        for start in [0, 1, 7, 19, 59, 60] {
            let tail: Vec<usize> = l.offsets_from(start).collect();
            assert_eq!(tail, all[start.min(60)..].to_vec(), "start {start}");
        }
    }

    #[test]
    fn broadcast_repeats_with_zero_stride() {
        let l = Layout::contiguous([3, 1])
            .broadcast_as(&Shape::from([2, 3, 4]), "t")
            .unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
        assert_eq!(l.offsets().take(5).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1]);
    }

    #[test]
    fn view_merges_only_contiguous_groups() {
        let l = Layout::contiguous([2, 3, 4]).permute(&[1, 0, 2]).unwrap();
        // dims 0 and 1 swapped: the last dim can split, but [3,2] cannot merge.
        assert!(l.view(&Shape::from([3, 2, 2, 2])).is_some());
        assert!(l.view(&Shape::from([6, 4])).is_none());
        let n = Layout::contiguous([4, 6]).narrow(1, 1, 4).unwrap();
        let v = n.view(&Shape::from([4, 2, 2])).unwrap();
        assert_eq!(v.strides(), &[6, 2, 1]);
    }
}
