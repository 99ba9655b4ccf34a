//! systemd: sd_notify with signals (a fake NOTIFY_SOCKET) and socket activation.

use super::*;

/// Datagrams sent to a fake NOTIFY_SOCKET, one message per datagram.
fn notifications(sock: &UnixDatagram, until: &str, limit: Duration) -> Vec<String> {
    sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < limit {
        if let Ok(n) = sock.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).into_owned();
            let done = m.lines().any(|l| l == until);
            got.push(m);
            if done {
                return got;
            }
        }
    }
    panic!("no {until} within {limit:?}; got {got:?}");
}

#[test]
fn sd_notify_ready_reload_watchdog_and_a_draining_stop() {
    let dir = scratch("notify");
    let path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    let mut d = Daemon::start(
        &dir,
        "[server]\nshutdown_grace_secs = 30\n",
        &[("NOTIFY_SOCKET", path.to_str().unwrap()), ("WATCHDOG_USEC", "400000")],
    );
    let got = notifications(&sock, "READY=1", Duration::from_secs(60));
    let ready = got.iter().find(|m| m.contains("READY=1")).unwrap();
    assert!(ready.contains("STATUS=serving SmolLM2-135M-Instruct.Q4_1"), "{ready}");
    // The engine loop's heartbeat feeds the watchdog.
    notifications(&sock, "WATCHDOG=1", Duration::from_secs(5));
    // SIGHUP: RELOADING=1 (with the monotonic time), then READY=1 again; the daemon serves on.
    d.signal("HUP");
    let got = notifications(&sock, "READY=1", Duration::from_secs(10));
    let all = got.join("\n");
    assert!(all.contains("RELOADING=1") && all.contains("MONOTONIC_USEC="), "{all}");
    assert_eq!(d.http("GET", "/health", "").0, 200);
    // SIGTERM with a request in flight: STOPPING=1, new requests get 503, the running one
    // finishes, the process exits 0.
    let mut stream =
        open_stream(&d.socket, r#"{"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": true}"#);
    d.signal("TERM");
    notifications(&sock, "STOPPING=1", Duration::from_secs(10));
    let (st, body) = d.http("POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#);
    assert_eq!(st, 503, "{body}");
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains(r#""finish_reason":"length""#) && rest.contains("[DONE]"),
        "the in-flight request completes: {rest}"
    );
    let status = d.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!d.socket.exists(), "the socket file is removed");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn socket_activation_serves_on_the_passed_socket() {
    let dir = scratch("activate");
    let socket = dir.join("activated.sock");
    let m = model();
    let mut child = Command::new("systemd-socket-activate")
        .args([
            "-l",
            socket.to_str().unwrap(),
            "-E",
            "HOME",
            env!("CARGO_BIN_EXE_inferd"),
            "serve",
            "--user",
            "--model",
            &m,
            "--threads",
            "2",
            "--socket",
            "/nonexistent/not-used.sock",
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("systemd-socket-activate (apt-get install systemd)");
    wait_for("the activation socket", Duration::from_secs(10), || socket.exists());
    // The first connection starts the daemon, which serves it on the inherited socket.
    let (st, body) = http(
        &socket,
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#,
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains(" Paris."), "{body}");
    assert!(!Path::new("/nonexistent/not-used.sock").exists());
    let _ = child.kill();
    let _ = child.wait();
    let _ = Command::new("pkill").args(["-f", socket.to_str().unwrap()]).status();
    let _ = std::fs::remove_dir_all(dir);
}

/// Socket-activated with nothing loaded, the daemon exits after `idle_exit`, and a client that
/// connects while it is exiting is served by the next start. The test plays the socket unit: it
/// holds the listening socket, passes it as LISTEN_FDS, and starts the daemon again once the
/// first one has exited.
#[test]
fn an_idle_socket_activated_daemon_exits_and_loses_no_request() {
    use std::io::BufRead;
    let dir = scratch("idle-exit");
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    std::os::unix::fs::symlink(model(), store.join("m.gguf")).unwrap();
    let cfg = dir.join("inferd.toml");
    let toml = format!("[server]\nmodel_store = \"{}\"\nkeep_alive = \"0\"\nidle_exit = \"1s\"\n", store.display());
    std::fs::write(&cfg, toml).unwrap();
    let socket = dir.join("inferd.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let start = || -> Child {
        // The passed socket on descriptor 3, LISTEN_PID the daemon's own (exec keeps the pid).
        let fd = std::os::fd::OwnedFd::from(listener.try_clone().unwrap());
        Command::new("sh")
            .args(["-c", "exec 3<&0 0</dev/null; export LISTEN_FDS=1 LISTEN_PID=$$; exec \"$@\"", "sh"])
            .arg(env!("CARGO_BIN_EXE_inferd"))
            .args(["serve", "--user", "--config", cfg.to_str().unwrap(), "--threads", "2"])
            .stdin(Stdio::from(fd))
            .stderr(Stdio::piped())
            .env("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent")
            .env("XDG_DATA_HOME", &dir)
            .env("XDG_STATE_HOME", &dir)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .spawn()
            .unwrap()
    };
    let completion = r#"{"model": "m", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#;
    let mut first = start();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let err = first.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("first: {line}");
            let _ = tx.send(line);
        }
    });
    let (st, b) = http(&socket, "POST", "/v1/completions", completion);
    assert!(st == 200 && b.contains(" Paris."), "{st} {b}");
    // The model unloads (keep_alive 0), then the daemon exits; a client connects right then.
    let t0 = Instant::now();
    loop {
        let line = rx.recv_timeout(Duration::from_secs(30)).expect("the idle exit");
        if line.contains("exiting") {
            break;
        }
    }
    let s = socket.clone();
    let client = std::thread::spawn(move || http(&s, "POST", "/v1/completions", completion));
    let status = first.wait().unwrap();
    assert!(status.success(), "{status:?}");
    eprintln!("the idle daemon exited {:.1} s after its last request", t0.elapsed().as_secs_f64());
    // The socket unit starts it again for the waiting connection.
    let mut second = start();
    let (st, b) = client.join().unwrap();
    assert!(st == 200 && b.contains(" Paris."), "the request made while the daemon exited: {st} {b}");
    let _ = second.kill();
    let _ = second.wait();
    let _ = std::fs::remove_dir_all(dir);
}
