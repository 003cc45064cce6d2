//! A safetensors file written as a stream: the header is computed up front from the names,
//! dtypes and shapes of the tensors, then their bytes are appended in that order, so a file of
//! any size is written without ever holding more than the piece being written.
//!
//! The file is written to a hidden sibling (`.NAME.partial`) and renamed into place by
//! [`SafetensorsWriter::finish`], so an interrupted write never leaves a truncated file under
//! the final name (and a file memory-mapped by a reader is never truncated under it).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::QmoeError;

/// One tensor of a file being written: its name, element type and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name in the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A tensor named `name` of `dtype` and `shape`.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Bytes of its data.
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes one safetensors file tensor by tensor (see the module docs).
pub struct SafetensorsWriter {
    out: BufWriter<File>,
    partial: PathBuf,
    path: PathBuf,
    tensors: Vec<TensorSpec>,
    /// Index of the tensor being written, and the bytes of it written so far.
    next: usize,
    written: usize,
}

/// Bytes of the buffer between the writer and the file.
const BUFFER_BYTES: usize = 8 << 20;

impl SafetensorsWriter {
    /// Starts the file at `path` holding `tensors` in this order (with `metadata` in the
    /// header): writes the header, and expects the tensors' bytes next.
    pub fn create(
        path: &Path,
        metadata: Option<HashMap<String, String>>,
        tensors: Vec<TensorSpec>,
    ) -> crate::Result<Self> {
        let invalid = |reason: String| QmoeError::InvalidArgument {
            argument: format!("tensors of `{}`", path.display()),
            reason,
        };
        let mut offset = 0;
        let infos = tensors
            .iter()
            .map(|t| {
                let n = t.byte_len();
                let info = TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + n),
                };
                offset += n;
                (t.name.clone(), info)
            })
            .collect();
        let header = Metadata::new(metadata, infos).map_err(|e| invalid(e.to_string()))?;
        let mut header = serde_json::to_vec(&header).map_err(|e| invalid(e.to_string()))?;
        // The data section starts 8-byte aligned, as safetensors' own writer does.
        header.resize(header.len().next_multiple_of(8), b' ');
        let name = path
            .file_name()
            .ok_or_else(|| invalid("the path names no file".into()))?;
        let partial = path.with_file_name(format!(".{}.partial", name.to_string_lossy()));
        let write_error = |error| QmoeError::Write {
            path: path.to_path_buf(),
            error,
        };
        let mut out =
            BufWriter::with_capacity(BUFFER_BYTES, File::create(&partial).map_err(write_error)?);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&header))
            .map_err(write_error)?;
        Ok(Self {
            out,
            partial,
            path: path.to_path_buf(),
            tensors,
            next: 0,
            written: 0,
        })
    }

    /// The tensors of the file, in order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Appends `bytes` of tensor `name`, which must be the tensor being written (a tensor may
    /// come in several pieces); writing past its end or out of order is an error.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> crate::Result<()> {
        let Some(t) = self.tensors.get(self.next) else {
            return Err(self.misuse(format!("tensor `{name}` written after the last tensor")));
        };
        if t.name != name {
            return Err(self.misuse(format!(
                "tensor `{name}` written where `{}` comes next",
                t.name
            )));
        }
        let len = t.byte_len();
        if self.written + bytes.len() > len {
            return Err(self.misuse(format!(
                "{} bytes written for tensor `{name}` of {len} bytes",
                self.written + bytes.len()
            )));
        }
        self.out.write_all(bytes).map_err(|e| self.write_error(e))?;
        self.written += bytes.len();
        if self.written == len {
            self.next += 1;
            self.written = 0;
        }
        Ok(())
    }

    /// Checks that every tensor was written, flushes the file and renames it into place.
    pub fn finish(mut self) -> crate::Result<PathBuf> {
        if let Some(t) = self.tensors.get(self.next) {
            let missing = format!("tensor `{}` is incomplete at file end", t.name);
            return Err(self.misuse(missing));
        }
        self.out.flush().map_err(|e| self.write_error(e))?;
        std::fs::rename(&self.partial, &self.path).map_err(|e| self.write_error(e))?;
        Ok(self.path.clone())
    }

    /// An I/O error while writing, naming the file.
    fn write_error(&self, error: std::io::Error) -> QmoeError {
        QmoeError::Write {
            path: self.path.clone(),
            error,
        }
    }

    /// A caller's mistake, naming the file.
    fn misuse(&self, reason: String) -> QmoeError {
        QmoeError::InvalidArgument {
            argument: format!("tensors of `{}`", self.path.display()),
            reason,
        }
    }
}

impl Drop for SafetensorsWriter {
    /// An unfinished file is removed (a finished one was renamed away).
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.partial);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_file_reads_back_and_misuse_is_refused() {
        let dir = std::env::temp_dir().join(format!("qmoe-stwriter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let tensors = vec![
            TensorSpec::new("b", Dtype::BF16, vec![2, 3]),
            TensorSpec::new("a", Dtype::U8, vec![5]),
            TensorSpec::new("c", Dtype::F32, vec![2]),
        ];
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let mut w = SafetensorsWriter::create(&path, Some(meta), tensors.clone()).unwrap();
        let values = [1.0f32, -2.5, 0.375, 3.0, 4.0, -0.0];
        let bf16: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        w.write("b", &bf16[..4]).unwrap();
        w.write("b", &bf16[4..]).unwrap();
        let e = w.write("c", &[0; 8]).unwrap_err().to_string();
        assert!(e.contains("tensor `c` written where `a` comes next"), "{e}");
        w.write("a", &[1, 2]).unwrap();
        w.write("a", &[3, 4, 5]).unwrap();
        assert!(matches!(
            w.write("c", &[0; 12]),
            Err(QmoeError::InvalidArgument { reason, .. })
                if reason == "12 bytes written for tensor `c` of 8 bytes"
        ));
        let c: Vec<u8> = [7f32, 8.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write("c", &c).unwrap();
        assert!(!path.exists(), "only the partial file exists before finish");
        assert_eq!(w.finish().unwrap(), path);

        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (n, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(n % 8, 0);
        assert_eq!(header.metadata().as_ref().unwrap()["format"], "pt");
        let b = st.tensor("b").unwrap();
        assert_eq!((b.dtype(), b.shape()), (Dtype::BF16, &[2, 3][..]));
        let back: Vec<f32> = b
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(back, values);
        assert_eq!(st.tensor("a").unwrap().data(), &[1, 2, 3, 4, 5]);
        assert_eq!(st.tensor("c").unwrap().data()[4..], 8f32.to_le_bytes());

        // An unfinished file leaves nothing behind.
        let short = dir.join("short.safetensors");
        let mut w = SafetensorsWriter::create(&short, None, tensors).unwrap();
        w.write("b", &bf16).unwrap();
        assert!(matches!(
            w.finish(),
            Err(QmoeError::InvalidArgument { reason, .. }) if reason.contains("`a`")
        ));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
