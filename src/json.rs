//! JSON that round-trips: serde_json writes NaN and ±infinity as `null`, so a value holding
//! one would be stored (or published) as something else than what the caller gave. This
//! module finds such floats before anything is written.

use serde::Serialize;
use serde::ser;

/// Why the probe stopped.
#[derive(Debug)]
pub(crate) enum NotFinite {
    /// A NaN or infinite float.
    Float,
    /// The value's own `Serialize` failed; serde_json reports that on the real pass.
    Other,
}

impl std::fmt::Display for NotFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a NaN or infinite number has no JSON form")
    }
}

impl std::error::Error for NotFinite {}

impl ser::Error for NotFinite {
    fn custom<T: std::fmt::Display>(_msg: T) -> Self {
        NotFinite::Other
    }
}

/// True when `value` contains a NaN or infinite `f32`/`f64` anywhere.
pub(crate) fn has_non_finite<T: Serialize + ?Sized>(value: &T) -> bool {
    matches!(value.serialize(Probe), Err(NotFinite::Float))
}

fn found() -> R {
    Err(NotFinite::Float)
}

/// A serializer that produces nothing and fails on the first non-finite float.
struct Probe;

type R = Result<(), NotFinite>;

impl ser::Serializer for Probe {
    type Ok = ();
    type Error = NotFinite;
    type SerializeSeq = Probe;
    type SerializeTuple = Probe;
    type SerializeTupleStruct = Probe;
    type SerializeTupleVariant = Probe;
    type SerializeMap = Probe;
    type SerializeStruct = Probe;
    type SerializeStructVariant = Probe;

    fn serialize_bool(self, _: bool) -> R {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> R {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> R {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> R {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> R {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> R {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> R {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> R {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> R {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> R {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> R {
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> R {
        if v.is_finite() { Ok(()) } else { found() }
    }
    fn serialize_f64(self, v: f64) -> R {
        if v.is_finite() { Ok(()) } else { found() }
    }
    fn serialize_char(self, _: char) -> R {
        Ok(())
    }
    fn serialize_str(self, _: &str) -> R {
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> R {
        Ok(())
    }
    fn serialize_none(self) -> R {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> R {
        v.serialize(Probe)
    }
    fn serialize_unit(self) -> R {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, v: &T) -> R {
        v.serialize(Probe)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        v: &T,
    ) -> R {
        v.serialize(Probe)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
    fn serialize_tuple(self, _: usize) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Probe, NotFinite> {
        Ok(Probe)
    }
}

impl ser::SerializeSeq for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTuple for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeMap for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> R {
        k.serialize(Probe)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeStruct for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeStructVariant for Probe {
    type Ok = ();
    type Error = NotFinite;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, v: &T) -> R {
        v.serialize(Probe)
    }
    fn end(self) -> R {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::has_non_finite;
    use std::collections::BTreeMap;

    #[test]
    fn finds_non_finite_floats_at_any_depth() {
        assert!(has_non_finite(&f64::NAN));
        assert!(has_non_finite(&f32::INFINITY));
        assert!(has_non_finite(&vec![1.0, f64::NEG_INFINITY]));
        assert!(has_non_finite(&Some(BTreeMap::from([("a", f64::NAN)]))));
        assert!(!has_non_finite(&vec![1.0, 2.5, -0.0]));
        assert!(!has_non_finite(
            &serde_json::json!({"a": [1, "x", null, 2.5]})
        ));
        assert!(!has_non_finite(&()));
    }
}
