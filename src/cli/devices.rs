//! `ember devices`: the PJRT plugin, its platform and devices.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use ember_dense::pjrt::{Client, DeviceInfo, Plugin};

use super::backend::PluginArgs;

#[derive(Args, Clone, Debug)]
pub struct DevicesArgs {
    #[command(flatten)]
    pub plugin: PluginArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct DevicesReport {
    pub plugin: PathBuf,
    pub api_version: String,
    pub platform: String,
    pub platform_version: String,
    pub devices: Vec<DeviceInfo>,
}

impl std::fmt::Display for DevicesReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "plugin {} (PJRT C API {})",
            self.plugin.display(),
            self.api_version
        )?;
        write!(f, "platform {} {}", self.platform, self.platform_version)?;
        for d in &self.devices {
            write!(f, "\n  device {}: {}", d.id, d.kind)?;
        }
        Ok(())
    }
}

pub fn run(args: &DevicesArgs) -> anyhow::Result<DevicesReport> {
    let path = args.plugin.path();
    let plugin = Plugin::load(&path)?;
    let (major, minor) = plugin.api_version();
    let client = Client::new(plugin)?;
    Ok(DevicesReport {
        plugin: path,
        api_version: format!("{major}.{minor}"),
        platform: client.platform_name()?,
        platform_version: client.platform_version()?,
        devices: client.devices()?,
    })
}
