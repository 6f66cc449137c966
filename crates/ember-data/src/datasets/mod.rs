//! Readers of well-known datasets (`torchvision.datasets`), from files already on disk:
//! ember never downloads.

mod fashion_mnist;

pub use fashion_mnist::FashionMnist;
