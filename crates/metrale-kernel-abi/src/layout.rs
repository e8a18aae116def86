//! How a kernel's parameters are laid out: [`KernelParams`], the layout every parameter struct
//! describes of itself ([`ParamsLayout`], one [`Field`] per parameter), and `kernel_params!`,
//! which defines a struct and its layout from one list of fields.
//!
//! Invariants:
//! - A parameter struct is `#[repr(C, packed(4))]` with its device pointers and 8-byte scalars
//!   first, so every field sits at its natural alignment and the struct's bytes are exactly the
//!   kernel's parameter buffer (CUDA lays parameters out at their natural alignment, in order,
//!   with no padding after the last); `kernel_params!` checks the alignment at compile time and
//!   bytemuck's `Pod` derive refuses any padding.
//! - The field list is the kernel's parameter list: `kernels/abi.cuh` turns it into the macro
//!   the kernel's signature is written with (`KV_STORE_PARAMS`, ...), so the two cannot drift.

/// What a parameter is, as the kernel receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// A device address ([`crate::DevicePtr`]), a typed C pointer on the device.
    Ptr,
    /// `uint32_t`.
    U32,
    /// `float`.
    F32,
    /// `uint64_t`.
    U64,
}

impl FieldKind {
    /// Bytes of the parameter (also its alignment).
    pub const fn size(self) -> usize {
        match self {
            FieldKind::Ptr | FieldKind::U64 => 8,
            FieldKind::U32 | FieldKind::F32 => 4,
        }
    }

    /// The scalar kinds' C type (pointers name theirs in [`Field::c_type`]).
    pub const fn scalar_c_type(self) -> &'static str {
        match self {
            FieldKind::Ptr => "void*",
            FieldKind::U32 => "uint32_t",
            FieldKind::F32 => "float",
            FieldKind::U64 => "uint64_t",
        }
    }
}

/// One parameter of a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Its name, in the struct and in the kernel's signature.
    pub name: &'static str,
    /// Its kind.
    pub kind: FieldKind,
    /// Its C type in the kernel's signature, `__restrict__` included (`OutT` stands for the
    /// output element type of a kernel compiled for several).
    pub c_type: &'static str,
    /// Its byte offset in the struct and in the kernel's parameter buffer.
    pub offset: usize,
}

/// The layout of one parameter struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamsLayout {
    /// The struct's name (Rust and C).
    pub name: &'static str,
    /// The C macro that expands to the kernel's parameter list (`KV_STORE_PARAMS`).
    pub c_macro: &'static str,
    /// Bytes of the struct: the kernel's parameter buffer.
    pub size: usize,
    /// Its fields in order.
    pub fields: &'static [Field],
    /// Its documentation, line by line.
    pub doc: &'static [&'static str],
}

impl ParamsLayout {
    /// Whether some pointer's C type is the output type parameter `OutT` (the C macro then
    /// takes it as an argument).
    pub fn is_generic(&self) -> bool {
        self.fields.iter().any(|f| f.c_type.contains("OutT"))
    }

    /// `(offset, size)` of each parameter in order: what the driver reports of a compiled
    /// kernel (`cuFuncGetParamInfo`), and what the PTX `.entry` declares.
    pub fn params(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.fields.iter().map(|f| (f.offset, f.kind.size()))
    }
}

/// A kernel's parameter struct: plain bytes the backend passes as the kernel's parameters.
pub trait KernelParams: bytemuck::Pod + std::fmt::Debug {
    /// Its layout.
    const LAYOUT: ParamsLayout;
}

/// Whether `fields` lie back to back at their natural alignment from 0 (pointers and 8-byte
/// scalars before any 4-byte one), ending at `size`: the compile-time check of
/// `kernel_params!`.
pub const fn packed_naturally(fields: &[Field], size: usize) -> bool {
    let mut at = 0;
    let mut i = 0;
    while i < fields.len() {
        let f = fields[i];
        if f.offset != at || !f.offset.is_multiple_of(f.kind.size()) {
            return false;
        }
        at += f.kind.size();
        i += 1;
    }
    at == size
}

/// The Rust type of a field kind.
#[doc(hidden)]
#[macro_export]
macro_rules! __abi_field_type {
    (ptr) => {
        $crate::DevicePtr
    };
    (u32) => {
        u32
    };
    (f32) => {
        f32
    };
    (u64) => {
        u64
    };
}

/// The [`FieldKind`] and C type of a field.
#[doc(hidden)]
#[macro_export]
macro_rules! __abi_field_kind {
    (ptr $c:literal) => {
        ($crate::FieldKind::Ptr, $c)
    };
    (u32) => {
        ($crate::FieldKind::U32, "uint32_t")
    };
    (f32) => {
        ($crate::FieldKind::F32, "float")
    };
    (u64) => {
        ($crate::FieldKind::U64, "uint64_t")
    };
}

/// Defines a kernel parameter struct and its [`ParamsLayout`]:
///
/// ```text
/// kernel_params! {
///     /// `cache::kv_store`: ...
///     pub struct KvStoreParams("KV_STORE_PARAMS") {
///         /// K pool.
///         k_cache: ptr "bf16* __restrict__",
///         /// Rows.
///         rows: u32,
///     }
/// }
/// ```
#[macro_export]
macro_rules! kernel_params {
    (
        #[doc = $doc:literal]
        $(#[doc = $more:literal])*
        pub struct $name:ident($c_macro:literal) {
            $(
                $(#[doc = $fdoc:literal])*
                $field:ident : $kind:ident $($c:literal)?
            ),* $(,)?
        }
    ) => {
        #[doc = $doc]
        $(#[doc = $more])*
        #[repr(C, packed(4))]
        #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name {
            $(
                $(#[doc = $fdoc])*
                pub $field: $crate::__abi_field_type!($kind),
            )*
        }

        impl $crate::KernelParams for $name {
            const LAYOUT: $crate::ParamsLayout = $crate::ParamsLayout {
                name: stringify!($name),
                c_macro: $c_macro,
                size: std::mem::size_of::<$name>(),
                fields: &[
                    $(
                        $crate::Field {
                            name: stringify!($field),
                            kind: $crate::__abi_field_kind!($kind $($c)?).0,
                            c_type: $crate::__abi_field_kind!($kind $($c)?).1,
                            offset: std::mem::offset_of!($name, $field),
                        },
                    )*
                ],
                doc: &[$doc $(, $more)*],
            };
        }

        const _: () = assert!(
            $crate::layout::packed_naturally(
                <$name as $crate::KernelParams>::LAYOUT.fields,
                std::mem::size_of::<$name>(),
            ),
            concat!(stringify!($name), ": pointers and 8-byte scalars go first, each field at its natural alignment")
        );
    };
}
