//! `#[derive(Module)]`: implements ember-nn's `Module` trait (`visit`, `visit_mut`,
//! `set_training`, `is_training`) from a struct's fields, as PyTorch's `nn.Module` finds
//! parameters, buffers and submodules from its attributes.
//!
//! What each field is comes from its type, through ember-nn's `ModuleField` trait, not from
//! its spelling: a `Tensor` is a parameter (a buffer with `#[module(buffer)]`), any `Module`
//! is a child, `Option<T>` and `Vec<T>` (and `[T; N]`) hold what `T` holds, and plain data
//! (`usize`, `f64`, `bool`, `String`, `Device`, `DType`, ...) is nothing. A field of another
//! type is a compile error naming `ModuleField`; mark it `#[module(skip)]`.
//!
//! Names are PyTorch's state-dict names: the field's name (`fc1.weight`), a `Vec` or array
//! element's index (`layers.0.weight`), the position for tuple structs (`0.weight`); an
//! `Option` that is `None` contributes nothing. Order is Note [Visit order] of ember-nn's
//! `module.rs`: the struct's own parameters, then its own buffers, then its children, each
//! group in field order.
//!
//! Attributes:
//! - on a field: `#[module(skip)]` (not visited, not told the mode), `#[module(buffer)]`
//!   (tensors of the field are buffers), `#[module(parameter)]` (the default),
//!   `#[module(name = "0")]` (the name in the state dict, when it differs from the field's);
//! - on the struct: `#[module(crate = ember_nn)]`, the path of ember-nn in generated code;
//!   by default `::ember::nn` (the facade), or `::ember_nn` inside the ember-nn package.
//!
//! A field `training: Training` (ember-nn's atomic flag) holds the mode (`module.training`,
//! read with `self.training.get()`); without one, `is_training` is the first child's mode (true
//! for a module without children). A `training: bool` field is a compile error saying so:
//! `train()`/`eval()` take `&self`, which a plain `bool` cannot follow.
//!
//! `syn`/`quote`/`proc-macro2` are the standard tools for a derive: `syn` parses the struct and
//! its attributes with spans for error messages, `quote` builds the impl. They are already in
//! the build through `thiserror` and `clap`, so they cost no new downloads.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::quote;
use syn::{parse_macro_input, Data, DeriveInput, Fields, Ident, LitStr, Path, Type};

/// Derives `Module` (ember-nn) from the struct's fields; see the crate docs.
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// One visited field: how to reach it, its state-dict name, its type and whether its tensors
/// are buffers.
struct Field {
    access: TokenStream2,
    name: String,
    ty: Type,
    buffer: bool,
}

/// The options of a field's `#[module(..)]` attributes.
#[derive(Default)]
struct FieldOptions {
    skip: bool,
    buffer: bool,
    name: Option<String>,
}

fn field_options(attrs: &[syn::Attribute]) -> syn::Result<FieldOptions> {
    let mut o = FieldOptions::default();
    let (mut parameter, mut buffer_seen) = (false, false);
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                o.skip = true;
            } else if meta.path.is_ident("buffer") {
                o.buffer = true;
                buffer_seen = true;
            } else if meta.path.is_ident("parameter") {
                parameter = true;
            } else if meta.path.is_ident("name") {
                let lit: LitStr = meta.value()?.parse()?;
                if lit.value().is_empty() {
                    return Err(meta.error("a state-dict name cannot be empty"));
                }
                o.name = Some(lit.value());
            } else {
                return Err(meta.error(
                    "unknown field option; expected `skip`, `buffer`, `parameter` or `name = \"..\"`",
                ));
            }
            Ok(())
        })?;
        if parameter && buffer_seen {
            return Err(syn::Error::new_spanned(
                attr,
                "a field cannot be both `parameter` and `buffer`",
            ));
        }
    }
    Ok(o)
}

/// The ember-nn path from `#[module(crate = ..)]`, else the default of the crate docs.
fn crate_path(attrs: &[syn::Attribute]) -> syn::Result<Path> {
    let mut path = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                path = Some(meta.value()?.parse::<Path>()?);
                Ok(())
            } else {
                Err(meta.error("unknown struct option; expected `crate = path::to::ember_nn`"))
            }
        })?;
    }
    Ok(match path {
        Some(p) => p,
        None if std::env::var("CARGO_PKG_NAME").as_deref() == Ok("ember-nn") => syn::parse_quote!(::ember_nn),
        None => syn::parse_quote!(::ember::nn),
    })
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(
            &input.ident,
            "#[derive(Module)] supports structs only",
        ));
    };
    let krate = crate_path(&input.attrs)?;
    let mut fields = Vec::new();
    let mut training = None;
    let named: Vec<(TokenStream2, String, &syn::Field)> = match &data.fields {
        Fields::Named(f) => f
            .named
            .iter()
            .map(|f| {
                let id = f.ident.as_ref().expect("named fields have names");
                let name = id.to_string();
                let name = name.strip_prefix("r#").unwrap_or(&name).to_owned();
                (quote!(#id), name, f)
            })
            .collect(),
        Fields::Unnamed(f) => f
            .unnamed
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let index = syn::Index::from(i);
                (quote!(#index), i.to_string(), f)
            })
            .collect(),
        Fields::Unit => Vec::new(),
    };
    for (access, name, f) in named {
        let o = field_options(&f.attrs)?;
        if o.skip {
            continue;
        }
        if name == "training" && is_bool(&f.ty) {
            return Err(syn::Error::new_spanned(
                &f.ty,
                "a module's `training` field is a `Training` (ember::nn::Training), not a `bool`: \
                 train()/eval() take &self, so the flag sits in an atomic; read it with `self.training.get()`",
            ));
        }
        if name == "training" && is_training(&f.ty) {
            training = Some(access);
            continue;
        }
        fields.push(Field {
            access,
            name: o.name.unwrap_or(name),
            ty: f.ty.clone(),
            buffer: o.buffer,
        });
    }

    let support = quote!(#krate::derive_support);
    let field_visits = |mutable: bool| -> TokenStream2 {
        let mut out = TokenStream2::new();
        // Own parameters, own buffers, then children (Note [Visit order]).
        for pass in 0..3 {
            for field in &fields {
                let Field {
                    access,
                    name,
                    ty,
                    buffer,
                } = field;
                let (role, kind) = match pass {
                    0 if !buffer => (quote!(Tensor), quote!(Parameter)),
                    1 if *buffer => (quote!(Tensor), quote!(Buffer)),
                    2 => (quote!(Child), quote!(Parameter)),
                    _ => continue,
                };
                let call = if mutable {
                    quote!(#support::ModuleField::visit_field_mut(
                        &mut self.#access,
                        &#support::join_name(prefix, #name),
                        #support::TensorKind::#kind,
                        f,
                    )?;)
                } else {
                    quote!(#support::ModuleField::visit_field(
                        &self.#access,
                        &#support::join_name(prefix, #name),
                        #support::TensorKind::#kind,
                        f,
                    );)
                };
                out.extend(quote! {
                    if ::core::matches!(<#ty as #support::ModuleField>::ROLE, #support::FieldRole::#role) {
                        #call
                    }
                });
            }
        }
        out
    };
    let visit = field_visits(false);
    let visit_mut = field_visits(true);
    let accesses: Vec<&TokenStream2> = fields.iter().map(|f| &f.access).collect();
    let set_own = training
        .as_ref()
        .map(|t| quote!(#support::Training::set(&self.#t, training);));
    let is_training = match &training {
        Some(t) => quote!(#support::Training::get(&self.#t)),
        None => quote! {
            ::core::option::Option::<bool>::None
                #(.or_else(|| #support::ModuleField::is_training_field(&self.#accesses)))*
                .unwrap_or(true)
        },
    };

    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let f_ident = Ident::new("f", Span::call_site());
    Ok(quote! {
        impl #impl_generics #support::Module for #ident #ty_generics #where_clause {
            fn visit(
                &self,
                prefix: &str,
                #f_ident: &mut dyn FnMut(&str, &#support::Tensor, #support::TensorKind),
            ) {
                let _ = (&prefix, &#f_ident);
                #visit
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                #f_ident: &mut dyn FnMut(
                    &str,
                    &mut #support::Tensor,
                    #support::TensorKind,
                ) -> #support::Result<()>,
            ) -> #support::Result<()> {
                let _ = (&prefix, &#f_ident);
                #visit_mut
                Ok(())
            }

            fn set_training(&self, training: bool) {
                #set_own
                #(#support::ModuleField::set_training_field(&self.#accesses, training);)*
            }

            fn is_training(&self) -> bool {
                #is_training
            }
        }
    })
}

/// True for a type named `Training` (ember-nn's mode flag, under any path).
fn is_training(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Training"))
}

/// True for the type `bool`.
fn is_bool(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.is_ident("bool"))
}
