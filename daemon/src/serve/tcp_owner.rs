//! The local user behind a loopback TCP connection.
//!
//! TCP carries no credentials (`SO_PEERCRED` answers only on Unix sockets), but a loopback
//! client's socket is one of this host's, and the kernel lists each socket's owner in
//! `/proc/net/tcp` and `/proc/net/tcp6`: the client's is the line whose local address is the
//! connection's peer and whose remote address is the connection's local end. The owner is the
//! uid that created the socket, as `SO_PEERCRED` gives the one that connected; the 4-tuple
//! cannot name another socket while the daemon holds its end open. Chosen over a per-port cap
//! (one user would still fill every port) and over tokens (every app would need one, and the
//! listener exists for apps that cannot do more than plain HTTP).
//!
//! The owner only rations: connections and requests are counted per owner as they are per uid
//! on the Unix socket, and users take turns by it. Rights (model management, a full status)
//! stay with the Unix socket's peers. A client the tables do not list (another network
//! namespace, a peer that is not loopback) counts as [`super::conn::ANONYMOUS_UID`], as every
//! TCP client once did.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The uid owning the client end of the loopback connection from `peer` to `local`.
pub fn owner(local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    let (local, peer) = (unmapped(local), unmapped(peer));
    if !peer.ip().is_loopback() {
        return None;
    }
    // A client's socket is listed in the table of its own family, whatever the listener's.
    let tables: &[&str] = if peer.is_ipv4() { &["/proc/net/tcp", "/proc/net/tcp6"] } else { &["/proc/net/tcp6"] };
    tables.iter().find_map(|t| std::fs::read_to_string(t).ok().and_then(|text| find(&text, local, peer)))
}

/// An IPv4 address carried in IPv6 (`::ffff:127.0.0.1`, a dual-stack listener's peer) as IPv4.
fn unmapped(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// The owner in `table` (the text of `/proc/net/tcp` or `tcp6`) of the socket whose local
/// address is `peer` and whose remote address is `local`.
fn find(table: &str, local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (mine, theirs, uid) = (f.get(1)?, f.get(2)?, f.get(7)?);
        (address(mine)? == peer && address(theirs)? == local).then(|| uid.parse().ok())?
    })
}

/// An address as the tables print it: the IP's 32-bit words in the host's byte order, in hex,
/// then `:` and the port in hex (`0100007F:1F90` is 127.0.0.1:8080 on a little-endian host).
fn address(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |w: &str| u32::from_str_radix(w, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(unmapped(SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table line for a socket from `mine` to `theirs` owned by `uid`, as this host prints it.
    fn line(mine: SocketAddr, theirs: SocketAddr, uid: u32) -> String {
        let hex = |a: SocketAddr| {
            let ip = match a.ip() {
                IpAddr::V4(v4) => format!("{:08X}", u32::from_ne_bytes(v4.octets())),
                IpAddr::V6(v6) => v6
                    .octets()
                    .chunks_exact(4)
                    .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            };
            format!("{ip}:{:04X}", a.port())
        };
        format!(
            "   1: {} {} 01 00000000:00000000 00:00000000 00000000  {uid:>5}        0 12345 1",
            hex(mine),
            hex(theirs)
        )
    }

    #[test]
    fn the_client_end_names_its_owner() {
        let server: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let client: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let table = [
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
                .to_string(),
            line(server, "0.0.0.0:0".parse().unwrap(), 0), // the listener
            line(server, client, 0),                       // the daemon's end
            line(client, server, 1000),                    // the client's end
            line("127.0.0.1:40001".parse().unwrap(), server, 1001),
        ]
        .join("\n");
        assert_eq!(find(&table, server, client), Some(1000));
        assert_eq!(find(&table, server, "127.0.0.1:40001".parse().unwrap()), Some(1001));
        assert_eq!(find(&table, server, "127.0.0.1:40002".parse().unwrap()), None);
        // A dual-stack listener sees the IPv4 client as ::ffff:127.0.0.1.
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:40000".parse().unwrap();
        assert_eq!(find(&table, unmapped("[::ffff:127.0.0.1]:8080".parse().unwrap()), unmapped(mapped)), Some(1000));
        // IPv6 loopback.
        let (s6, c6): (SocketAddr, SocketAddr) = ("[::1]:8080".parse().unwrap(), "[::1]:50000".parse().unwrap());
        let table6 = ["header".to_string(), line(c6, s6, 42)].join("\n");
        assert_eq!(find(&table6, s6, c6), Some(42));
        // Only loopback peers are looked up.
        assert_eq!(owner(server, "192.0.2.1:40000".parse().unwrap()), None);
    }

    #[test]
    fn a_real_loopback_connection_is_owned_by_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_end, peer) = listener.accept().unwrap();
        let me = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap();
        assert_eq!(owner(server_end.local_addr().unwrap(), peer), Some(me));
        drop(client);
    }
}
