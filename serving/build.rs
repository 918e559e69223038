//! The gRPC service's messages and server trait, generated from
//! `proto/inference.proto` (protox parses it: no protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/inference.proto");
    let descriptors = protox::compile(["inference.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(descriptors)?;
    Ok(())
}
