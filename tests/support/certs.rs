//! Certificates for TLS tests, made by the `openssl` command (Debian's `openssl` package,
//! installed with apt when missing): a private certificate authority per test, server
//! certificates for chosen names and validity windows (an expired one included), client
//! certificates. Every file lives in the directory the test gives; nothing is trusted
//! system-wide.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A private certificate authority in `dir`.
pub struct Pki {
    dir: PathBuf,
    /// The CA's certificate (PEM): what a client trusts.
    pub ca_cert: PathBuf,
    ca_key: PathBuf,
    serial: std::cell::Cell<u32>,
}

/// A certificate and its private key, both PEM files.
#[derive(Clone, Debug)]
pub struct Issued {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, PKCS#8, unencrypted, mode 0600).
    pub key: PathBuf,
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validity {
    /// From a day ago for ten years.
    Current,
    /// 2020-01-01 to 2020-01-02: expired.
    Expired,
    /// From 2090 on: not valid yet.
    Future,
}

fn openssl(args: &[&str], cwd: &Path) {
    super::apt_install("openssl", || {
        Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let out = Command::new("openssl")
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn private_key(path: &Path) {
    let _ = std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600));
}

impl Pki {
    /// A new authority named `name` in `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>, name: &str) -> Pki {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = dir.join(format!("{name}-ca.key"));
        let ca_cert = dir.join(format!("{name}-ca.crt"));
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                ca_key.to_str().unwrap(),
                "-out",
                ca_cert.to_str().unwrap(),
                "-days",
                "3650",
                "-subj",
                &format!("/CN=pgbox test CA {name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
            &dir,
        );
        private_key(&ca_key);
        Pki {
            dir,
            ca_cert,
            ca_key,
            serial: std::cell::Cell::new(1),
        }
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A server certificate for `names` (DNS names and IP addresses; the first is also the
    /// common name), valid as `validity` says.
    pub fn server(&self, file_stem: &str, names: &[&str], validity: Validity) -> Issued {
        let san = names
            .iter()
            .map(|n| {
                if n.parse::<std::net::IpAddr>().is_ok() {
                    format!("IP:{n}")
                } else {
                    format!("DNS:{n}")
                }
            })
            .collect::<Vec<_>>()
            .join(",");
        let ext = format!(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName={san}\n"
        );
        self.issue(
            file_stem,
            names.first().copied().unwrap_or("server"),
            &ext,
            validity,
        )
    }

    /// A client certificate whose common name is `common_name` (PostgreSQL's `cert`
    /// authentication maps it to the role of that name).
    pub fn client(&self, file_stem: &str, common_name: &str) -> Issued {
        let ext = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n";
        self.issue(file_stem, common_name, ext, Validity::Current)
    }

    fn issue(&self, stem: &str, common_name: &str, ext: &str, validity: Validity) -> Issued {
        let key = self.dir.join(format!("{stem}.key"));
        let csr = self.dir.join(format!("{stem}.csr"));
        let cert = self.dir.join(format!("{stem}.crt"));
        let ext_file = self.dir.join(format!("{stem}.ext"));
        std::fs::write(&ext_file, ext).unwrap();
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                key.to_str().unwrap(),
                "-out",
                csr.to_str().unwrap(),
                "-subj",
                &format!("/CN={common_name}"),
            ],
            &self.dir,
        );
        private_key(&key);
        // `openssl ca` is the one subcommand of OpenSSL 3.0 that sets arbitrary validity
        // dates (an expired certificate); it wants a small database of its own.
        let db = self.dir.join(format!("{stem}.index"));
        std::fs::write(&db, "").unwrap();
        let serial = self.serial.get();
        self.serial.set(serial + 1);
        let config = self.dir.join(format!("{stem}.cnf"));
        std::fs::write(
            &config,
            format!(
                "[ca]\ndefault_ca = test\n[test]\ndatabase = {db}\nnew_certs_dir = {dir}\n\
                 serial = {serial_file}\ndefault_md = sha256\npolicy = any\ncopy_extensions = none\n\
                 unique_subject = no\n[any]\ncommonName = supplied\n",
                db = db.display(),
                dir = self.dir.display(),
                serial_file = self.dir.join(format!("{stem}.serial")).display(),
            ),
        )
        .unwrap();
        std::fs::write(
            self.dir.join(format!("{stem}.serial")),
            format!("{:04X}\n", 0x1000 + serial),
        )
        .unwrap();
        let (start, end) = match validity {
            Validity::Current => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs() as i64;
                (asn1_time(now - 86_400), asn1_time(now + 10 * 365 * 86_400))
            }
            Validity::Expired => ("20200101000000Z".to_owned(), "20200102000000Z".to_owned()),
            Validity::Future => ("20900101000000Z".to_owned(), "20910101000000Z".to_owned()),
        };
        openssl(
            &[
                "ca",
                "-batch",
                "-config",
                config.to_str().unwrap(),
                "-cert",
                self.ca_cert.to_str().unwrap(),
                "-keyfile",
                self.ca_key.to_str().unwrap(),
                "-in",
                csr.to_str().unwrap(),
                "-out",
                cert.to_str().unwrap(),
                "-startdate",
                &start,
                "-enddate",
                &end,
                "-extfile",
                ext_file.to_str().unwrap(),
                "-notext",
            ],
            &self.dir,
        );
        Issued { cert, key }
    }
}

/// `seconds` since the epoch as ASN.1 GeneralizedTime (`YYYYMMDDHHMMSSZ`).
fn asn1_time(seconds: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(seconds).unwrap();
    format!(
        "{:04}{:02}{:02}{:02}{:02}{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}
