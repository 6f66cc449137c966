//! `set_num_threads` / `get_num_threads` (`torch.set_num_threads`): the CPU backend's kernels
//! run on a pool of the set size and give the same results. In a process of its own: the
//! setting is process-wide.

use crate::common::{assert_close, in_own_process};
use ember_core::{get_num_threads, set_num_threads, DType, Device, Error, Tensor};

#[test]
fn the_thread_count_is_settable_and_results_do_not_change() {
    in_own_process(
        "threads::the_thread_count_is_settable_and_results_do_not_change",
        || {
            ember_core::manual_seed(0).unwrap();
            let a = Tensor::randn([256, 300], DType::F32, Device::Cpu).unwrap();
            let b = Tensor::randn([300, 200], DType::F32, Device::Cpu).unwrap();
            let default = get_num_threads();
            assert!(default >= 1);
            let reference = (a.matmul(&b).unwrap(), a.sum_all().unwrap(), a.exp().unwrap());
            for n in [1, 2, 3] {
                set_num_threads(n).unwrap();
                assert_eq!(get_num_threads(), n);
                let (m, s, e) = (a.matmul(&b).unwrap(), a.sum_all().unwrap(), a.exp().unwrap());
                assert_close(&m, &reference.0, 1e-5, 1e-5); // gemm may split k differently
                assert_eq!(s.to_vec::<f32>().unwrap(), reference.1.to_vec::<f32>().unwrap());
                assert_eq!(e.to_vec::<f32>().unwrap(), reference.2.to_vec::<f32>().unwrap());
            }
            assert!(matches!(set_num_threads(0), Err(Error::InvalidArgument { .. })));
            assert_eq!(get_num_threads(), 3);
        },
    );
}
