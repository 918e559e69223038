//! The devices a plan places tables on.

use serde::{Deserialize, Serialize};

use crate::ShardingError;

/// One device ("SparseCore"): its memory and the bandwidth of its memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// Memory for shards, in bytes: the planner's capacity for this device.
    pub memory_bytes: u64,
    /// Bytes per second of random row reads (the planner's lookup cost).
    pub memory_bandwidth: f64,
    /// Disk for disk-tier shards, in bytes (`None`, the default: as much as
    /// they need). The planner uses it only when given a disk tier
    /// ([`PlannerOptions::disk_tier`](crate::PlannerOptions::disk_tier)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

/// Devices grouped into hosts of `devices_per_host` (table-row-wise keeps a
/// table inside one host), with one device-to-device bandwidth.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// The devices, by index (a plan's `device`).
    pub devices: Vec<Device>,
    /// Devices per host, at least 1: host `h` has devices
    /// `h * devices_per_host..(h + 1) * devices_per_host` (the last host may
    /// have fewer).
    pub devices_per_host: usize,
    /// Bytes per second between two devices (inputs, pooled rows, gradients).
    pub device_bandwidth: f64,
}

/// [`Device::memory_bandwidth`]'s default, in bytes per second: about
/// 13 GB/s of random 512-byte row reads, measured on the development machine.
pub const DEFAULT_MEMORY_BANDWIDTH: f64 = 13e9;
/// [`Topology::device_bandwidth`]'s default, in bytes per second: 10 GB/s,
/// measured in-process (a memory copy); set it to the network's for
/// multi-host estimates.
pub const DEFAULT_DEVICE_BANDWIDTH: f64 = 10e9;

impl Topology {
    /// `n` equal devices on one host.
    pub fn uniform(n: usize, memory_bytes: u64) -> Self {
        Self {
            devices: vec![
                Device {
                    memory_bytes,
                    memory_bandwidth: DEFAULT_MEMORY_BANDWIDTH,
                    disk_bytes: None,
                };
                n
            ],
            devices_per_host: n.max(1),
            device_bandwidth: DEFAULT_DEVICE_BANDWIDTH,
        }
    }

    /// The number of devices.
    pub fn num_devices(&self) -> usize {
        self.devices.len()
    }

    /// The number of hosts: devices over `devices_per_host`, rounded up.
    pub fn num_hosts(&self) -> usize {
        self.devices.len().div_ceil(self.devices_per_host.max(1))
    }

    /// The devices of host `h`.
    pub fn host_devices(&self, h: usize) -> std::ops::Range<usize> {
        let per = self.devices_per_host;
        h * per..((h + 1) * per).min(self.devices.len())
    }

    /// Checks that there is a device, `devices_per_host` is at least 1 and
    /// every bandwidth is positive; fails with [`ShardingError::Topology`].
    pub fn validate(&self) -> Result<(), ShardingError> {
        let fail = |m: String| Err(ShardingError::Topology(m));
        if self.devices.is_empty() {
            return fail("no devices".into());
        }
        if self.devices.len() > crate::plan::MAX_DEVICES {
            return fail(format!(
                "{} devices: at most {} (what a plan holds)",
                self.devices.len(),
                crate::plan::MAX_DEVICES
            ));
        }
        if self.devices_per_host == 0 {
            return fail("devices_per_host must be at least 1".into());
        }
        if self.device_bandwidth.is_nan() || self.device_bandwidth <= 0.0 {
            return fail(format!(
                "device_bandwidth {} must be > 0",
                self.device_bandwidth
            ));
        }
        for (i, d) in self.devices.iter().enumerate() {
            if d.memory_bandwidth.is_nan() || d.memory_bandwidth <= 0.0 {
                return fail(format!("device {i}: memory_bandwidth must be > 0"));
            }
        }
        Ok(())
    }
}

/// Parses `12GiB`, `512MB`, `1.5GiB`, `1000` (bytes).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a size (e.g. 16GiB, 512MB, 1000000)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024.0f64.powi(4),
        u => {
            return Err(format!(
                "'{text}': unknown unit '{u}' (B, KB, MB, GB, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    if value < 0.0 || !value.is_finite() {
        return Err(format!("'{text}' is not a size"));
    }
    let bytes = (value * scale).round();
    // 2^64 and above would saturate to u64::MAX: a different size.
    if bytes >= u64::MAX as f64 {
        return Err(format!("'{text}' is more than a size can be (16 EiB)"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("16GiB"), Ok(16 << 30));
        for absurd in [
            "18446744073709551616",
            "18446744073709551615TiB",
            "99999999999999999999999999GiB",
        ] {
            assert!(
                parse_bytes(absurd).unwrap_err().contains("more than"),
                "{absurd}"
            );
        }
        assert_eq!(parse_bytes("1.5 GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("-1GB").is_err());
    }
}
