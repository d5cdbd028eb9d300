//! A private RabbitMQ node for TLS tests: the machine's `rabbitmq-server`, run as a node of
//! its own (`pgbox-tls-<pid>@localhost`) on free loopback ports, its configuration, data,
//! logs and Erlang cookie (`HOME`) in a directory the test gives. One plain listener, one TLS
//! listener that verifies client certificates and requires one. The shared node on 5672 is
//! never touched. Stopped (its process group killed) and its directory removed on drop.

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// A running private node.
pub struct PrivateRabbit {
    dir: PathBuf,
    child: Child,
    /// The plain AMQP port (127.0.0.1).
    pub plain_port: u16,
    /// The TLS port (127.0.0.1).
    pub tls_port: u16,
    /// The user the node was created with.
    pub user: String,
    /// Its password.
    pub password: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PrivateRabbit {
    /// Starts a node in `dir` (created; removed on drop) whose TLS listener presents
    /// `cert`/`key` and trusts client certificates signed by `ca`; returns once both
    /// listeners accept connections (bounded: 180 s).
    pub fn start(dir: &Path, ca: &Path, cert: &Path, key: &Path) -> PrivateRabbit {
        super::support::apt_install("rabbitmq-server", || Path::new(SERVER).exists());
        std::fs::create_dir_all(dir).unwrap();
        let (plain_port, tls_port, dist_port) = (free_port(), free_port(), free_port());
        let user = "pgbox-app".to_owned();
        let password = format!("pw-{}", uuid::Uuid::now_v7().simple());
        let conf = format!(
            "listeners.tcp.default = 127.0.0.1:{plain_port}\n\
             listeners.ssl.default = 127.0.0.1:{tls_port}\n\
             ssl_options.cacertfile = {ca}\n\
             ssl_options.certfile = {cert}\n\
             ssl_options.keyfile = {key}\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = true\n\
             default_user = {user}\n\
             default_pass = {password}\n\
             default_permissions.configure = .*\n\
             default_permissions.read = .*\n\
             default_permissions.write = .*\n\
             log.console = false\n\
             log.file.level = info\n",
            ca = ca.display(),
            cert = cert.display(),
            key = key.display(),
        );
        std::fs::write(dir.join("rabbitmq.conf"), conf).unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(dir.join("rabbitmq-env.conf"), "").unwrap();
        let log = std::fs::File::create(dir.join("server.out")).unwrap();
        let started = Instant::now();
        let child = Command::new(SERVER)
            .env("HOME", dir)
            .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
            .env(
                "RABBITMQ_NODENAME",
                format!("pgbox-tls-{}@localhost", std::process::id()),
            )
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            // Its own process group, so that drop ends the script and the VM together.
            .process_group(0)
            .spawn()
            .expect("start rabbitmq-server");
        let mut node = PrivateRabbit {
            dir: dir.to_owned(),
            child,
            plain_port,
            tls_port,
            user,
            password,
        };
        // Bounded: 180 s, a probe every 250 ms. The listeners open last in the boot.
        for _ in 0..720 {
            if let Ok(Some(status)) = node.child.try_wait() {
                panic!(
                    "rabbitmq-server exited ({status}): {}",
                    std::fs::read_to_string(dir.join("server.out")).unwrap_or_default()
                );
            }
            let up = |port| TcpStream::connect(("127.0.0.1", port)).is_ok();
            if up(plain_port) && up(tls_port) {
                eprintln!("private rabbitmq node up in {:?}", started.elapsed());
                return node;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!(
            "private rabbitmq node not up within 180 s: {}",
            std::fs::read_to_string(dir.join("server.out")).unwrap_or_default()
        );
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        // Bounded: 30 s for a clean stop, then SIGKILL.
        for _ in 0..120 {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "private rabbitmq node's files kept in {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
